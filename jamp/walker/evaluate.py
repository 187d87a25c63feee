"""The one loop that re-runs a jaxpr equation by equation under an interpreter.

An `Interpreter` evaluates a closed jaxpr in an environment (`Env`) mapping its variables to
values: for each equation it reads the operands, applies the rule its `rules` table holds for
the primitive (by name) or else its `default` (bind the primitive as it is), inside the
equation's source context, and writes the results. An interpreter writes only what it
changes: a rule for the primitives it treats differently, or an override of one of the hooks
(`read`, `operands`, `default`, `write`, `new_env`, `finish`). Values may be any pytree the
interpreter's rules understand (the debugger carries (low, shadow) pairs).

Bodies of higher-order primitives are evaluated by the rules, with the helpers of
`jamp.walker.control_flow`; a body may return side results (`Env.extras`: a dict of arrays,
the debugger's probes, anomaly mode's error codes) beside its outputs, which those helpers
carry out of loops and branches.

Example: an interpreter that doubles every `sin`:

    class Doubled(Interpreter):
        def _sin(self, env, eqn, invals):
            return [2 * x for x in self.default(env, eqn, invals)]
        rules = {"sin": _sin}

    Doubled().evaluate(jax.make_jaxpr(f)(x), [x])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Sequence

import jax
import numpy as np

from jamp import _jax_internals as jx
from jamp.policy.dtypes import dtype_of

__all__ = ["Body", "Env", "Interpreter", "Rule", "literal_value"]


@dataclasses.dataclass
class Env:
    """The state of one evaluation of one jaxpr; interpreters subclass it to keep more (where
    a body sits in the program, facts about values).

    Attributes:
      values: each variable's value.
      extras: the side results of this evaluation, by key (see `Interpreter.run`).
      index: the index of the equation being evaluated (-1 before the first).
    """

    values: dict = dataclasses.field(default_factory=dict)
    extras: dict = dataclasses.field(default_factory=dict)
    index: int = -1


# A rule: (interpreter, env, equation, operand values) -> the equation's result values.
Rule = Callable[[Any, Env, jx.JaxprEqn, list], list]
# A body evaluator, as the control-flow helpers take it: (body, args) -> (outputs, extras).
Body = Callable[[jx.ClosedJaxpr, Sequence[Any]], tuple[list, dict]]


def literal_value(atom: jx.Literal) -> Any:
    """A literal's value: an array value as it is, anything else as a numpy value of the
    literal's dtype (so that a cast of it stays a literal when re-traced)."""
    value = atom.val
    if isinstance(value, jax.Array):
        return value
    dtype = dtype_of(atom.aval)
    return value if dtype is None else np.asarray(value, dtype)


class Interpreter:
    """Evaluates closed jaxprs equation by equation; subclasses set `rules` and override hooks.

    Attributes:
      rules: this interpreter's rule per primitive name; primitives without one go to
        `default`. A rule is a function (or method) `rule(interpreter, env, eqn, invals)`
        returning the list of the equation's results; it runs inside `jx.equation_context`.
    """

    rules: ClassVar[Mapping[str, Rule]] = {}

    # -- the loop ------------------------------------------------------------------------------

    def run(self, closed: jx.ClosedJaxpr, args: Sequence[Any], env: Env | None = None,
            consts: Sequence[Any] | None = None) -> tuple[list, dict]:
        """Evaluates `closed` on `args` in `env` (a fresh `new_env(closed)` when None); returns the
        outputs and the side results `finish(env)` gives. `consts` replaces the jaxpr's own
        consts (values a caller passes afresh)."""
        env = self.new_env(closed) if env is None else env
        jaxpr = closed.jaxpr
        for var, value in zip(jaxpr.constvars, closed.consts if consts is None else consts,
                              strict=True):
            self.write(env, var, value)
        for var, value in zip(jaxpr.invars, args, strict=True):
            self.write(env, var, value)
        for i, eqn in enumerate(jaxpr.eqns):
            env.index = i
            invals = self.operands(env, eqn)
            rule = self.rules.get(eqn.primitive.name)
            with jx.equation_context(eqn):
                outs = rule(self, env, eqn, invals) if rule is not None else \
                    self.default(env, eqn, invals)
            for var, value in zip(eqn.outvars, outs, strict=True):
                self.write(env, var, value)
        return [self.read(env, v) for v in jaxpr.outvars], self.finish(env)

    def evaluate(self, closed: jx.ClosedJaxpr, args: Sequence[Any], env: Env | None = None,
                 consts: Sequence[Any] | None = None) -> list:
        """The outputs of `run` (side results left in `env`)."""
        return self.run(closed, args, env, consts)[0]

    def body(self, make_env: Callable[[jx.ClosedJaxpr], Env] | None = None) -> Body:
        """A body evaluator for `jamp.walker.control_flow`: each call runs a body in a fresh
        env `make_env(body)` (default `new_env`), as a loop's body may be traced more than
        once."""
        make = self.new_env if make_env is None else make_env
        return lambda closed, args: self.run(closed, args, make(closed))

    # -- hooks ---------------------------------------------------------------------------------

    def new_env(self, closed: jx.ClosedJaxpr) -> Env:
        """The env of an evaluation of `closed` no caller set up (a subclass returns its own
        kind, set up for that jaxpr)."""
        return Env()

    def read(self, env: Env, atom: Any) -> Any:
        """An atom's value: a literal's `literal_value`, a variable's value in `env`."""
        if isinstance(atom, jx.Literal):
            return literal_value(atom)
        return env.values[atom]

    def operands(self, env: Env, eqn: jx.JaxprEqn) -> list:
        """The values an equation's rule receives (a subclass may cast them)."""
        return [self.read(env, a) for a in eqn.invars]

    def write(self, env: Env, var: jx.Var, value: Any) -> None:
        """Records a variable's value (a subclass may note facts about it)."""
        env.values[var] = value

    def default(self, env: Env, eqn: jx.JaxprEqn, invals: list) -> list:
        """An equation without a rule: its primitive bound as it is, with its own params."""
        return jx.bind(eqn, eqn.params, invals)

    def finish(self, env: Env) -> dict:
        """The side results of an evaluation that has ended."""
        return env.extras

"""Precision rules: the autocast setting of a module, a named scope or a library function.

`jamp.autocast(fn, rules=[(pattern, setting), ...])` gives the equations a pattern matches a
setting of their own (a dtype, "off", "on" or an op table; see `check_setting`): Apex's "force
particular layers to a type" and "keep BatchNorm in float32", as data. The rules are tried in
order and the first that matches an equation decides it; after the user's rules come the op
table's function rules (`OpTable.functions`). This module holds what the rules see of an
equation and the region that results for it, for the interpreter, the dataflow pass and the
tools that name modules (the profiler, the AMP report, the precision debugger):

- **Module paths.** Every `jax.named_scope` an equation was traced in is a segment of its path,
  outermost first: Flax linen's module scopes (`Net/Block_0/Dense_0`; a method other than
  `__call__` adds `.method`), scopes users open, NNX modules named by their graph path while
  autocast traces them (`nnx_scopes`), `record_function` labels. autocast's own region markers
  and the scopes `jnp.einsum` opens (named by its subscripts) are not modules, and a name
  repeated right after itself is one module calling its own method again (linen's
  `SelfAttention`). Inside the body of a `jit`, `scan`, `cond`... an equation's name stack is
  relative to the call: `equation_path` takes the call's path.
- **Module patterns** are globs over those segments: `*`, `?` and `[...]` within a segment,
  `**` for any number of segments. A pattern matches a module whose path it matches or ends
  with, and everything inside that module: `BatchNorm_0` matches `Net/BatchNorm_0` and
  `Net/Block_1/BatchNorm_0`; a pattern starting with `/` is anchored at the top
  (`/Net/Dense_0`). `module_pattern(path)` is the narrowest pattern for one module.
- **Function patterns** are the qualified name of a Python function, method or class
  (`optax.ctc_loss`, `jax.image.resize`, `flax.nnx.BatchNorm`), resolved as `pkgutil` resolves
  names: a pattern that resolves is a function pattern, any other is a module pattern. It
  matches the equations traced while that function (any method of that class) ran, read off
  the Python frames JAX keeps on each equation, and everything inside them.
- **Where a rule applies.** A module rule applies where its module's scope begins: autocast
  regions (`with jamp.autocast(...)`) opened inside the module nest inside it, those around it
  are overridden by it. A function rule applies outside every region.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import pkgutil
import re
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping, Sequence, cast

from jamp import _jax_internals as jx
from jamp.fp8.recipes import Recipe, check_recipe
from jamp.policy.autocast_tables import (
    OFF, ON, Kernel, OpRules, OpTable, Setting, check_setting)
from jamp.policy.dtypes import is_fp8_dtype
from jamp.transforms.autocast_rules import (MARKER_PREFIX, Region, apply_markers, parse_markers,
                                          sets_its_own_dtype)

_NONE: frozenset[int] = frozenset()


# -- module paths -----------------------------------------------------------------------------

def is_module_scope(name: str) -> bool:
    """Whether a scope name is a module path segment (not an autocast region marker, nor the
    subscripts `jnp.einsum` names its scope with)."""
    return bool(name) and not name.startswith(MARKER_PREFIX) and "->" not in name


def _extends(path: Sequence[str], name: str) -> bool:
    return is_module_scope(name) and (not path or path[-1] != name)


def module_path(outer: Iterable[str], names: Iterable[str]) -> tuple[str, ...]:
    """`outer` extended by the module scopes among `names` (outermost first)."""
    path = list(outer)
    for name in names:
        if _extends(path, name):
            path.append(name)
    return tuple(path)


def equation_path(eqn, outer: Sequence[str] = ()) -> tuple[str, ...]:
    """The module path the precision rules see for `eqn`.

    Args:
      eqn: an equation of a jaxpr.
      outer: for an equation inside the body of a call (`jit`, `scan`, `cond`...), the path of
        the call's equation (name stacks inside a body are relative to the call).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.transforms.rules import equation_path
      >>> def f(x):
      ...     with jax.named_scope("encoder"):
      ...         return jnp.sin(x)
      >>> eqn = jax.make_jaxpr(f)(1.0).jaxpr.eqns[0]
      >>> equation_path(eqn, outer=("Net",))
      ('Net', 'encoder')
    """
    return module_path(outer, jx.scope_names(eqn))


_GLOB_CHARACTERS = re.compile(r"([*?\[])")


def module_pattern(path: Sequence[str]) -> str:
    """The narrowest rule pattern that matches the module at `path` and everything inside it,
    and nothing else (`"**"`, every module, for the empty path of top-level equations).

    Example:
      >>> from jamp.transforms.rules import module_pattern
      >>> module_pattern(("Net", "Block_0", "Dense_0"))
      '/Net/Block_0/Dense_0'
    """
    if not path:
        return "**"
    return "/" + "/".join(_GLOB_CHARACTERS.sub(r"[\1]", segment) for segment in path)


# -- patterns ---------------------------------------------------------------------------------

_QUALIFIED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def _segments(pattern: str) -> tuple[bool, tuple[str, ...]]:
    """A module pattern's (anchored, segments); malformed patterns are refused."""
    anchored = pattern.startswith("/")
    body = pattern[1:] if anchored else pattern
    segments = tuple(body.split("/"))
    if not body or not all(segments):
        raise ValueError(
            f"Precision rule pattern {pattern!r} has an empty segment: a module pattern is "
            "'/'-separated names or globs ('Dense_0', 'Block_*/Dense_0', '/Net/Dense_0' from "
            "the top, '**' for every module).")
    bad = [s for s in segments if "**" in s and s != "**"]
    if bad:
        raise ValueError(
            f"Precision rule pattern {pattern!r}: '**' stands for whole segments only (in "
            f"{bad[0]!r}); use '*' within a segment.")
    return anchored, segments


def _glob(segments: tuple[str, ...], path: tuple[str, ...]) -> bool:
    """Whether `segments` (with `**` for any number of segments) match all of `path`."""
    if not segments:
        return not path
    head, rest = segments[0], segments[1:]
    if head == "**":
        return any(_glob(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatchcase(path[0], head) and _glob(rest, path[1:])


@functools.lru_cache(maxsize=1024)
def _resolved_codes(pattern: str) -> frozenset:
    """The code objects of the function, method or class methods a qualified name resolves to
    (empty when it resolves to none)."""
    if not _QUALIFIED_NAME.fullmatch(pattern):
        return frozenset()
    try:
        target = pkgutil.resolve_name(pattern)
    except (ImportError, AttributeError, ValueError):
        return frozenset()
    members = vars(target).values() if inspect.isclass(target) else (target,)
    return frozenset(code for member in members if (code := _code(member)) is not None)


def _code(obj: Any):
    """The code a function runs: through decorators (`functools.wraps`, `jax.jit`), partials,
    bound and static methods, and `jax.custom_jvp`/`custom_vjp` wrappers."""
    for _ in range(16):
        if isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
            obj = obj.__func__
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        elif callable(getattr(obj, "fun", None)) and not inspect.isfunction(obj):
            obj = obj.fun  # jax.custom_jvp / custom_vjp
        else:
            break
    return getattr(obj, "__code__", None) if inspect.isfunction(obj) else None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One precision rule, parsed.

    Attributes:
      pattern: as written.
      setting: what it sets (see `jamp.policy.autocast_tables.check_setting`).
      codes: a function rule's code objects (empty for a module rule).
      anchored / segments: a module rule's pattern.
      default: one of the op table's function rules (not required to match).
    """

    pattern: str
    setting: Setting
    codes: frozenset = frozenset()
    anchored: bool = False
    segments: tuple[str, ...] = ()
    default: bool = False

    @classmethod
    def of(cls, pattern: str, setting: Setting, default: bool = False) -> "Rule":
        codes = _resolved_codes(pattern)
        if codes:
            return cls(pattern, setting, codes, default=default)
        anchored, segments = _segments(pattern)
        return cls(pattern, setting, anchored=anchored, segments=segments, default=default)

    def depth(self, path: tuple[str, ...]) -> int | None:
        """How many segments of `path` name the outermost module this module rule matches (0:
        it matches every path), or None."""
        if not self.segments:
            return None
        segments = self.segments if self.anchored else ("**", *self.segments)
        return next((k for k in range(len(path) + 1) if _glob(segments, path[:k])), None)

    def apply(self, region: Region, start: Region) -> Region:
        """`region` with this rule's setting; `start` is the transform's own region ("on")."""
        setting = self.setting
        changes: dict[str, Any]
        if isinstance(setting, str) and setting == OFF:
            changes = dict(enabled=False)
        elif isinstance(setting, str) and setting == ON:
            changes = dict(enabled=True, dtype=start.dtype, table=start.table)
        elif isinstance(setting, OpTable):
            changes = dict(enabled=True, table=setting)
        elif isinstance(setting, OpRules):
            changes = dict(enabled=True, table=setting.applied_to(region.table))
        elif isinstance(setting, Kernel):
            changes = dict(enabled=True, kernel=setting.rule, rounded=setting.rounded)
        elif isinstance(setting, Recipe):
            # The module keeps the region's dtype; its linear layers' products (a function
            # rule's: all its products) run through jamp.fp8.
            changes = dict(enabled=True, fp8=setting, fp8_every=bool(self.codes))
        else:
            changes = dict(enabled=True, dtype=setting, entry_dtype=setting)
        if isinstance(setting, str) and setting == ON:
            changes.update(fp8=start.fp8, fp8_every=start.fp8_every)
        return dataclasses.replace(
            region, **{"as_is": False, "entry_dtype": None, "kernel": None, "rounded": False,
                       "fp8": None, "fp8_every": False, **changes})


class RuleSet:
    """The rules of one transform, in order: the user's, then its op table's function rules."""

    def __init__(self, rules: Sequence[Rule]):
        self.rules = tuple(rules)
        self.modules = any(r.segments for r in self.rules)
        self.sets_recipes = any(isinstance(r.setting, Recipe) for r in self.rules)
        by_code: dict = {}
        for i, rule in enumerate(self.rules):
            for code in rule.codes:
                by_code.setdefault(code, set()).add(i)
        self._by_code = {code: frozenset(found) for code, found in by_code.items()}
        self._choices: dict = {}
        self._hash = hash(self.rules)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, RuleSet) and self.rules == other.rules

    def functions_on(self, eqn) -> frozenset[int]:
        """The function rules whose function is on the Python stack that traced `eqn`."""
        return self.functions_among(jx.traceback_code(eqn)) if self._by_code else _NONE

    def functions_among(self, codes: Iterable[Any]) -> frozenset[int]:
        """The function rules whose function's code is among `codes` (a Python stack's)."""
        found = [self._by_code[c] for c in codes if c in self._by_code]
        return frozenset().union(*found) if found else _NONE

    def choose(self, path: tuple[str, ...], functions: frozenset[int]
               ) -> tuple[int, int] | None:
        """The first rule matching an equation at module `path` traced inside the functions of
        rules `functions`, and the depth it applies at (see `Rule.depth`; 0 for a function
        rule); None when none matches."""
        key = (path, functions)
        if key not in self._choices:
            self._choices[key] = next(self._matches(path, functions), None)
        return self._choices[key]

    def _matches(self, path, functions):
        for i, rule in enumerate(self.rules):
            depth = 0 if i in functions else rule.depth(path)
            if depth is not None:
                yield i, depth


@functools.lru_cache(maxsize=256)
def rule_set(rules: tuple[tuple[str, Setting], ...], table: OpTable) -> RuleSet | None:
    """The user's rules (checked by `checked_rules`) followed by `table`'s function rules, those
    that resolve in the running versions of their libraries; None when there are none."""
    parsed = [Rule.of(pattern, setting) for pattern, setting in rules]
    parsed += [rule for rule in (Rule.of(pattern, setting, default=True)
                                 for pattern, setting in table.functions) if rule.codes]
    return RuleSet(parsed) if parsed else None


def checked_rules(rules: Any) -> tuple[tuple[str, Setting], ...]:
    """`jamp.autocast`'s `rules=` argument as (pattern, setting) pairs, checked.

    Raises:
      TypeError: for rules that are not a list of (pattern, setting) pairs (or a mapping), or a
        pattern that is not a string.
      ValueError: for a malformed pattern or a setting autocast cannot use, naming it and the
        accepted forms.
    """
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    if not isinstance(rules, (list, tuple)):
        raise TypeError(
            f"autocast rules= takes a list of (pattern, setting) pairs, tried in order (e.g. "
            f"[('BatchNorm_0', jnp.float32), ('optax.ctc_loss', 'off')]); got {rules!r} of "
            f"type {type(rules).__name__}.")
    checked = []
    for rule in rules:
        if not isinstance(rule, (list, tuple)) or len(rule) != 2:
            raise TypeError(
                f"Each precision rule is a (pattern, setting) pair such as ('BatchNorm_0', "
                f"jnp.float32); got {rule!r}.")
        pattern, setting = rule
        if not isinstance(pattern, str):
            raise TypeError(
                f"Precision rule {tuple(rule)!r}: the pattern must be a string (a module path "
                f"glob or a function's qualified name); got {type(pattern).__name__}.")
        if not _resolved_codes(pattern):
            _segments(pattern)
        checked.append((pattern, check_rule_setting(setting, tuple(rule))))
    return tuple(checked)


def check_rule_setting(setting: Any, rule: Any) -> Setting:
    """A rule's setting checked: an fp8 recipe (see `check_fp8_setting`) or what
    `jamp.policy.autocast_tables.check_setting` accepts.

    Raises:
      TypeError: as `check_fp8_setting`.
      ValueError: as `check_setting`.
    """
    if is_fp8_dtype(setting) or isinstance(setting, Recipe):
        return cast(Setting, check_fp8_setting(setting, f"precision rule {rule[0]!r}: setting"))
    return check_setting(setting, rule)


def check_fp8_setting(value: Any, what: str) -> Recipe:
    """`value`, a recipe autocast can apply (a rule's setting or autocast's dtype).

    Raises:
      TypeError: for a float8 dtype, saying how to write a recipe.
    """
    return check_recipe(value, what)


# -- where an equation sits, and its region ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Scope:
    """What the precision rules know of the jaxpr being evaluated (`Region.scope`).

    Attributes:
      rules: the transform's rules.
      start: the transform's own region, which each equation's region is folded from.
      names: the scope names of the call equations around the jaxpr, outermost first (only
        the region markers among them when no rule names a module, so that a body called from
        many modules is transformed once).
      functions: the function rules matched by the call equations around it.
    """

    rules: RuleSet
    start: Region
    names: tuple[str, ...] = ()
    functions: frozenset[int] = _NONE

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.rules, self.start, self.names,
                                                self.functions)))

    def __hash__(self):
        return self._hash


@dataclasses.dataclass(frozen=True)
class Location:
    """Where an equation sits: its region, the rule that decided it (an index into the
    transform's rules, or None), its module path (empty without module rules), and the rule
    that matched it but was overridden by a region inside the rule's module that sets its
    own dtype (`jamp.autocast(..., dtype=...)`, O1's apply function), or None."""

    region: Region
    rule: int | None
    path: tuple[str, ...]
    overridden: int | None = None


def with_rules(region: Region, rules: RuleSet | None) -> Region:
    """The region a transform with `rules` evaluates its function in."""
    return region if rules is None else dataclasses.replace(region, scope=Scope(rules, region))


def locate(enclosing: Region, names: Sequence[str], functions: frozenset[int] = _NONE
           ) -> Location:
    """The location of an equation with the scope names `names` (its own name stack's, see
    `jx.scope_names`), traced inside the functions of rules `functions` (its own traceback's,
    see `RuleSet.functions_on`), in a jaxpr evaluated in `enclosing`.

    Without rules, the equation's region markers fold onto the enclosing region. With rules,
    the region is folded from the transform's own: the function rule that decides it first,
    then the markers and the module rule that decides it, in the order of their scopes.
    """
    scope = enclosing.scope
    if scope is None:
        return Location(apply_markers(enclosing, _markers(names)), None, ())
    names = scope.names + tuple(names)
    functions = scope.functions | functions
    path = module_path((), names)
    choice = scope.rules.choose(path, functions)
    region, overridden = _fold(scope, names, choice)
    kept = names if scope.rules.modules else tuple(
        name for name in names if name.startswith(MARKER_PREFIX))
    inner = dataclasses.replace(scope, names=kept, functions=functions)
    rule = None if choice is None else choice[0]
    return Location(dataclasses.replace(region, scope=inner),
                    None if overridden else rule, path, rule if overridden else None)


def region_of(enclosing: Region, eqn) -> Region:
    """The region of `eqn` in a jaxpr evaluated in `enclosing` (see `locate`)."""
    scope = enclosing.scope
    functions = _NONE if scope is None else scope.rules.functions_on(eqn)
    return locate(enclosing, jx.scope_names(eqn), functions).region


def region_here(enclosing: Region) -> Region:
    """The region an equation traced now, at this point of the function a transform with
    region `enclosing` is tracing, will be evaluated in: `region_of` for the name stack and
    Python stack open now (what `jamp.is_autocast_enabled` and its kin answer from)."""
    scope = enclosing.scope
    functions = (_NONE if scope is None
                 else scope.rules.functions_among(jx.current_traceback_code()))
    return locate(enclosing, jx.current_scope_names(), functions).region


def _markers(names: Iterable[str]) -> tuple:
    return tuple(m for name in names if name.startswith(MARKER_PREFIX)
                 for m in parse_markers(name))


def _fold(scope: Scope, names: Sequence[str], choice: tuple[int, int] | None
          ) -> tuple[Region, bool]:
    """The region folded from the transform's own, and whether a region marker that sets its
    own dtype (or turns autocast on or off) came after the chosen rule, overriding it."""
    region = scope.start
    if choice is None:
        return apply_markers(region, _markers(names)), False
    rule, depth = scope.rules.rules[choice[0]], choice[1]
    applied = overridden = False
    if depth == 0:
        region, applied = rule.apply(region, scope.start), True
    path: list[str] = []
    for name in names:
        if name.startswith(MARKER_PREFIX):
            markers = parse_markers(name)
            region = apply_markers(region, markers)
            overridden |= applied and any(map(sets_its_own_dtype, markers))
        elif _extends(path, name):
            path.append(name)
            if len(path) == depth:
                region, applied, overridden = rule.apply(region, scope.start), True, False
    return region, overridden


# -- rules that match nothing -----------------------------------------------------------------

class OverriddenRuleError(ValueError):
    """A precision rule decides nothing: a `jamp.autocast` region inside every module it
    matches sets its own dtype again (see `check_matched`)."""


def check_matched(rules: RuleSet, decided: set[int], places: Iterable[tuple], traced: str,
                  overridden: Iterable[int] = ()) -> None:
    """Refuses a user's rule that decided no equation of the traced function.

    Args:
      rules: the transform's rules.
      decided: the indices of the rules that decided some equation.
      places: the (module path, matched function rules) of the equations traced.
      traced: the traced function's name, for the message.
      overridden: the indices of the rules that matched equations whose region a
        `jamp.autocast` region inside the rule's module set again (`Location.overridden`).

    Raises:
      ValueError: naming the first such rule, and the rule that shadows it or the closest
        module paths traced.
    """
    places = list(places)
    for i, rule in enumerate(rules.rules):
        if rule.default or i in decided:
            continue
        shadowing = {first for path, functions in places
                     if (i in functions or rule.depth(path) is not None)
                     for first, _ in [rules.choose(path, functions) or (i, 0)]}
        if i in overridden:
            raise OverriddenRuleError(
                f"Precision rule {rule.pattern!r} decides nothing in {traced}: every equation "
                "it matches runs in a jamp.autocast region inside the module it matched, and "
                "that region sets its own dtype (as the apply function jamp.initialize returns "
                "at O1 does); the innermost setting wins. Write the rule for the modules inside "
                "that region ('Dense_*', 'Block_*/Dense_0'), or give it to the inner region's "
                "jamp.autocast.")
        if shadowing:
            first = rules.rules[min(shadowing)].pattern
            raise ValueError(
                f"Precision rule {rule.pattern!r} decides nothing in {traced}: every equation "
                f"it matches is matched first by the earlier rule {first!r} (the first rule "
                "that matches wins: put narrower rules first).")
        if rule.codes:
            raise ValueError(
                f"Precision rule {rule.pattern!r} matched nothing while {traced} was traced: "
                "no equation was traced inside that function.")
        raise ValueError(
            f"Precision rule {rule.pattern!r} matched nothing while {traced} was traced: no "
            f"equation sits in a module or named scope whose path ends with it, and it names "
            f"no function that could be imported.{_closest(rule, [p for p, _ in places])} "
            "Module patterns are globs over '/'-separated module paths ('Dense_0', "
            "'Block_*/Dense_0', '/Net/Dense_0' from the top); a function is named by its "
            "qualified name ('optax.ctc_loss').")


def _closest(rule: Rule, paths: list[tuple[str, ...]]) -> str:
    paths = [p for p in paths if p]
    if not paths:
        return " The function ran in no named scope (NNX modules are named only when autocast " \
               "reaches them; see nnx_scopes)."
    width = len(rule.segments)
    candidates = {("/" if rule.anchored else "") + "/".join(p[i:i + width])
                  for p in paths for i in ([0] if rule.anchored else range(len(p)))}
    close = difflib.get_close_matches(rule.pattern, sorted(candidates), n=3, cutoff=0.5)
    shown = close or sorted({"/".join(p) for p in paths})[:5]
    label = "Closest module paths traced" if close else "Module paths traced include"
    return f" {label}: {', '.join(map(repr, shown))}."


__all__ = [
    "check_fp8_setting", "check_matched", "check_rule_setting", "checked_rules",
    "equation_path", "is_module_scope", "locate", "Location", "module_path", "module_pattern",
    "OverriddenRuleError",
    "region_here", "region_of", "Rule", "rule_set", "RuleSet", "Scope", "with_rules"
]

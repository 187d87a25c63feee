"""The code blocks of a Markdown document, and how the docs tests run them.

The convention every document follows:

- Every fenced block names its language: python, pycon, bash, text, ...
- python blocks run, in the order of the document, in one namespace per document: a block may
  use what earlier blocks of the same document defined. Read top to bottom, a document is a
  script. By default the namespace starts empty; a test may seed it (docs/scaler.md's first
  examples take `params`, `loss_fn` and `batch` from tests/scaler/test_docs_scaler.py).
- pycon blocks are interactive sessions (`>>>` prompts and what Python prints, tracebacks
  included), run as doctests (ELLIPSIS, NORMALIZE_WHITESPACE) in that same namespace, in order
  with the others.
- A python or pycon block that must not run is marked by an HTML comment on the last non-blank
  line before its fence: `<!-- not run: why -->`. The reason is required.
- Blocks in any other language (shell commands, output, signatures) never run; they may not
  hold `>>>` prompts, which belong in pycon blocks.
"""

from __future__ import annotations

import dataclasses
import doctest
import pathlib
import re
import textwrap
from typing import Any, Callable

RUN_LANGUAGES = ("python", "pycon")
DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

_FENCE = re.compile(r"^\s*```(.*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")
_HEADING = re.compile(r"^#+\s+(.*?)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block.

    Attributes:
      language: the word after the opening fence ("" when there is none).
      code: the block's text, dedented.
      line: the 1-based line of the document where the code starts.
      heading: the nearest heading above the block, without its `#`s.
      not_run: the reason a `<!-- not run: ... -->` marker gives ("" when it gives none), or
        None when no marker precedes the block.
    """

    language: str
    code: str
    line: int
    heading: str
    not_run: str | None

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and self.not_run is None


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of the Markdown file at `path`, in order."""
    lines = pathlib.Path(path).read_text().splitlines()
    found, heading, i = [], "", 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            title = _HEADING.match(lines[i])
            if title:
                heading = title.group(1)
            i += 1
            continue
        language = opening.group(1).strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: a code block is never closed.")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.match(before)
        code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
        found.append(Block(language, code, i + 2, heading, marker.group(1) if marker else None))
        i = end + 1
    return found


def convention_errors(path: pathlib.Path) -> list[str]:
    """Where the document at `path` breaks the convention, one message per block."""
    errors = []
    for b in blocks(path):
        where = f"{path}:{b.line}"
        if not b.language:
            errors.append(f"{where}: the block names no language (python, pycon, bash, text).")
        elif b.language not in RUN_LANGUAGES and ">>>" in b.code:
            errors.append(f"{where}: a {b.language} block holds `>>>` prompts: make it pycon.")
        if b.not_run == "":
            errors.append(f"{where}: `<!-- not run: -->` needs a reason.")
        if b.not_run is not None and b.language not in RUN_LANGUAGES:
            errors.append(f"{where}: a {b.language or 'plain'} block never runs: drop its marker.")
    return errors


def run_block(block: Block, namespace: dict[str, Any], path: pathlib.Path) -> None:
    """Runs one python or pycon block in `namespace`; errors point at the document's lines."""
    if block.language == "python":
        # Blank lines in front put the code at its own line numbers in the document, so a
        # traceback names the Markdown file and line.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, str(path), "exec"), namespace)
        return
    if block.language != "pycon":
        raise ValueError(f"{path}:{block.line}: a {block.language} block does not run.")
    test = doctest.DocTestParser().get_doctest(
        block.code, namespace, f"{pathlib.Path(path).name}:{block.line}", str(path),
        block.line - 1)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    failures = []
    runner.run(test, out=failures.append, clear_globs=False)
    if runner.failures:
        raise AssertionError("".join(failures))


def run_document(
    path: pathlib.Path,
    namespace: dict[str, Any] | None = None,
    checks: dict[str, Callable[[dict[str, Any]], None]] | None = None,
) -> dict[str, Any]:
    """Runs every block of `path` that runs, in order, in one namespace, and returns it.

    Args:
      path: a Markdown file.
      namespace: what the blocks start from; by default nothing, so every name a block uses
        comes from an earlier block.
      checks: what the text says of the results: maps a piece of code to a function called
        with the namespace right after the block holding that code ran, before the next one.

    Raises:
      AssertionError: a block failed, or a check's code is in no block that runs.
    """
    namespace = {"__name__": "__doc_blocks__"} if namespace is None else namespace
    checks = dict(checks or {})
    for block in blocks(path):
        if block.runs:
            run_block(block, namespace, path)
            for code in [c for c in checks if c in block.code]:
                checks.pop(code)(namespace)
    assert not checks, f"{path}: no block that runs holds {sorted(checks)}"
    return namespace

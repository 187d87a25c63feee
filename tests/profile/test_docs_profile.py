"""docs/profile.md's code runs top to bottom and does what its text says."""

import json
import pathlib
import re

import jax

import doc_blocks
from helpers import needs_examples_extra

DOC = pathlib.Path(__file__).parents[2] / "docs" / "profile.md"


def lowered_converts(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).as_text()
    return len(re.findall(r"\bstablehlo\.convert\b", text))


def shown_output() -> list[str]:
    """The lines of the text block that shows what the AMP report's example prints."""
    block = next(b for b in doc_blocks.blocks(DOC)
                 if b.language == "text" and b.code.startswith("half_flops_fraction"))
    return block.code.splitlines()


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []


@needs_examples_extra("matplotlib")  # the report's plot
def test_blocks_run_and_do_what_the_text_says(capsys):
    def report(ns):
        report = ns["report"]
        args = (ns["params"], ns["opt_state"], ns["batch"])
        assert report.half_flops_fraction == 1.0
        assert sum(c.static_count for c in report.converts) == lowered_converts(ns["step"], *args)
        assert {"Block/Dense_0", "Block/MultiHeadDotProductAttention_0/query", "Block/LayerNorm_0",
                "(top level)"} <= {m.name for m in report.modules}
        assert "pow" in {c.primitive for c in report.converts}
        # What it prints is what the text shows, but for XLA's estimates (backend-dependent)
        # and the counts of the non-matmul primitives (they follow jax's own code).
        printed = capsys.readouterr().out.splitlines()
        shown = shown_output()
        assert printed[:2] == shown[:2]
        assert [line.split()[:5] for line in printed if line.startswith("dot_general")] == [
            line.split()[:5] for line in shown if line.startswith("dot_general")]
        for name in ("Block/Dense_0", "Block/MultiHeadDotProductAttention_0/query"):
            assert [line.split()[3:5] for line in printed if line.startswith(name)] == [
                line.split()[3:5] for line in shown if line.startswith(name)]

    def data(ns):
        assert json.loads(ns["saved"]) == ns["report"].to_dict()
        assert ns["ax"].patches and ns["ax"].get_legend() is not None

    def table(ns):
        rows = {row.key: row for row in ns["prof"].key_averages()}
        assert rows["step"].count == rows["hidden"].count == rows["jit_mlp"].count == 3
        ops = [row for key, row in rows.items() if key.startswith("jit_mlp::")]
        assert ops and all(row.count == 3 for row in ops)
        assert sum(row.flops for row in ops) == 3 * (2 * 16 * 64 * 128 + 2 * 16 * 128 * 32)
        # The table printed has the columns, and the kinds of rows, the text shows.
        printed = capsys.readouterr().out.splitlines()
        shown = next(b for b in doc_blocks.blocks(DOC) if b.language == "text").code.splitlines()
        assert printed[1].split() == shown[1].split()
        # Sorted by total CPU time: `step` holds every other range, so it comes first; where
        # `hidden` falls among jit_mlp's op rows depends on a few microseconds of timing.
        names = [line.split()[0] for line in printed[3:printed.index(printed[2], 3)]]
        assert names[0] == "step" and {"jit_mlp", "hidden"} <= set(names)
        assert all(name in rows for name in names)
        assert [line for line in printed if line][-1].startswith("Self CPU time total: ")

    doc_blocks.run_document(DOC, checks={
        "print(prof.key_averages().table(": table,
        "report = jamp.profile.amp_report(step": report,
        "ax = report.plot()": data,
    })

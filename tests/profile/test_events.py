"""The event lists of a profile (`jamp.profile.events`): every sort key, table option and
argument check, the exports, an empty profile, and the self times and per-call fields of
events built by hand."""

import json

import jax
import jax.numpy as jnp
import pytest

from jamp.profile import events as events_module, profile, record_function
from jamp.profile.events import EventList, FunctionEvent
from jamp.profile.trace import _ScopeRange

M, K, N = 8, 16, 32
W = jnp.full((K, N), 0.01, jnp.float32)
X = jnp.ones((M, K), jnp.float32)


def matmul_tanh(w, x):
    return jnp.tanh(x @ w)


def rows(prof):
    return {row.key: row for row in prof.key_averages()}


# --- Tables and exports ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def labelled_profile():
    step = jax.jit(matmul_tanh)
    step(W, X).block_until_ready()
    with profile(record_shapes=True, with_flops=True, profile_memory=True, with_stack=True,
                 with_modules=True) as prof:
        with record_function("step"):
            step(W, X).block_until_ready()
    return prof


@pytest.mark.parametrize("sort_by", events_module.SORT_KEYS)
def test_every_sort_key_sorts_events_and_averages(labelled_profile, sort_by):
    for listing in (labelled_profile.events(), labelled_profile.key_averages()):
        text = listing.table(sort_by=sort_by, row_limit=-1)
        keys = [line.split()[0] for line in text.splitlines()[3:-2]
                if line.strip() and not line.startswith(" " * 30)]
        values = [getattr(e, sort_by) for e in
                  sorted(listing, key=lambda e: getattr(e, sort_by), reverse=True)]
        assert len(keys) == len(listing) and values == sorted(values, reverse=True)


def test_table_options(labelled_profile):
    averages = labelled_profile.key_averages()
    assert len(averages.table(row_limit=0).splitlines()) == 5  # the header and footer only
    assert averages.table(row_limit=-1) == averages.table(row_limit=len(averages))
    assert "ms" in averages.table(time_unit="ms").splitlines()[3]
    text = averages.table(header="My step")
    assert text.splitlines()[1] == "My step"
    top = averages.table(top_level_events_only=True)
    assert "step" in top and "jit_matmul_tanh" not in top
    assert averages.table(max_name_column_width=None, max_src_column_width=None,
                          max_shapes_column_width=None)
    assert str(labelled_profile) == averages.table()
    # Averages of averages, and the total, are sums.
    again = averages.key_averages()
    assert [(r.key, r.count) for r in again] == [(r.key, r.count) for r in averages]
    assert labelled_profile.total_average().flops == averages.total_average().flops == (
        2 * M * K * N)


def test_table_arguments_are_checked(labelled_profile):
    averages = labelled_profile.key_averages()
    for kwargs, error in [({"row_limit": "10"}, TypeError), ({"row_limit": 1.5}, TypeError),
                          ({"header": 3}, TypeError), ({"time_unit": "ns"}, ValueError),
                          ({"top_level_events_only": 1}, TypeError),
                          ({"max_name_column_width": 0}, ValueError),
                          ({"sort_by": "self_gpu"}, ValueError)]:
        with pytest.raises(error):
            averages.table(**kwargs)


def test_an_empty_profile(tmp_path):
    with profile(with_stack=True) as prof:
        pass
    assert len(prof.key_averages()) == 0
    assert prof.key_averages().table() == "" == str(prof) == prof.events().table()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert not [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for metric in events_module.STACK_METRICS:
        prof.export_stacks(str(tmp_path / "stacks.txt"), metric)
        assert (tmp_path / "stacks.txt").read_text() == ""
    assert prof.total_average().count == 0


def test_exports_name_the_tables_keys(labelled_profile, tmp_path):
    path = tmp_path / "trace.json"
    labelled_profile.export_chrome_trace(str(path))
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert names == set(rows(labelled_profile))
    for metric in events_module.STACK_METRICS:
        labelled_profile.export_stacks(str(path), metric)
        for line in path.read_text().splitlines():
            assert line.rsplit(" ", 1)[0].rsplit(";", 1)[1] in names


# --- The numbers of events, by construction ----------------------------------------------------

def event(name, start, end, device_type="cpu", thread="t"):
    return FunctionEvent(id=0, name=name, kind="op", thread=thread, start_us=start,
                         end_us=end, device_type=device_type)


def test_self_time_takes_off_only_what_children_cover():
    parent = event("range", 0.0, 10.0)
    # A run that outlasts its range, and one on another thread overlapping it.
    parent.children = [event("run", 5.0, 15.0, thread="a"), event("run", 6.0, 8.0, thread="b")]
    assert parent.self_cpu_time_total == pytest.approx(5.0)
    nested = event("op", 0.0, 10.0)
    nested.children = [event("a", 1.0, 3.0), event("b", 4.0, 5.0)]
    assert nested.self_cpu_time_total == pytest.approx(7.0)


def test_single_events_have_torchs_per_call_fields_and_device_aliases():
    kernel = event("k", 0.0, 4.0, device_type="cuda")
    assert kernel.count == 1 and kernel.device_time == kernel.cuda_time == 4.0
    label = _ScopeRange(id=0, name="label", kind="range", thread="s", start_us=0.0,
                        end_us=4.0)
    label.members = [kernel, event("launch", 0.0, 1.0)]
    assert label.cuda_time_total == label.device_time_total == 4.0
    assert label.cpu_time == label.cpu_time_total == 1.0
    average = EventList([kernel]).key_averages()[0]
    assert average.calls == 1 and average.device_type == "cuda"

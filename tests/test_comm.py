"""The collectives XLA compiles match the analytic expectation of each layout."""

import json

import pytest

from jaxdist.compiled import comm_report, hlo
from models.inventory import plan_model
from tests.helpers import compiled_for

SLOW = pytest.mark.slow  # the quick loop (-m "not slow") keeps the default layout
# One case per path of traffic.expected: dense weights gathered over FSDP and their gradients
# reduced over data+FSDP, with tensor partial sums (the default layout; data=8, fsdp=8 and
# data=2,tensor=4 took the same lines with other sizes); experts not gathered (all-to-all
# only) and gathered over FSDP (reduce-scatter); microbatches and a llama's GQA; the embedding
# routed to its slices (64 tokens a device a microbatch against 128 rows beside tensor=2:
# jaxdist.kernels.lookup), its rows' all-to-alls, its vocabulary split, microbatches.
CASES = [
    pytest.param("expert=4,data=2", "tiny-moe", 1, None, marks=SLOW),
    pytest.param("expert=2,fsdp=2,tensor=2", "tiny-moe", 1, None, marks=SLOW),
    ("data=2,fsdp=2,tensor=2", "tiny", 1, None),
    pytest.param("fsdp=4,tensor=2", "tiny-llama", 2, None, marks=SLOW),
    pytest.param("data=2,fsdp=2,tensor=2", "tiny-llama", 2, 32, marks=SLOW),
]


@pytest.mark.parametrize("layout, model, microbatches, seq_len", CASES)
def test_measured_bytes_match_expected(layout, model, microbatches, seq_len):
    over = {"seq_len": seq_len} if seq_len else {}
    mc, mesh, jitted = compiled_for(layout, model, 16, microbatches, **over)
    rep = comm_report.report(jitted, plan_model(mc), jitted.layout)
    rows = rep["rows"]
    total = sum(r["bytes"] for r in rows)
    assert total > 0
    for r in rows:
        if r["expected_bytes"]:
            assert r["ratio"] == pytest.approx(1.0, abs=0.05), r
    # Left unmodelled: scalar reductions (loss, norms) and the few small reshardings XLA's CPU
    # partitioner adds around weights used in their stored layout (the router's, on tiny-moe).
    unexpected = sum(r["bytes"] for r in rows if not r["expected_bytes"])
    assert unexpected < 0.01 * total, [r for r in rows if not r["expected_bytes"]]
    axes = {r["axis"] for r in rows if r["bytes"] >= 1024}
    want = {a.split("=")[0] for a in layout.split(",")}
    # Every sharded axis carries traffic; data+fsdp reduce together where both exist.
    assert want <= {a for label in axes for a in label.split("+")}


MESH = {"data": 2, "fsdp": 2, "tensor": 2}
SNIPPET = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8], y: bf16[4,4]) -> f32[8] {
  %x = f32[8] parameter(0)
  %y = bf16[4,4] parameter(1)
  %ag = bf16[8,4]{1,0} all-gather(%y), channel_id=2, replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}
  %ags = (bf16[4,4], bf16[8,4]) all-gather-start(%y), channel_id=5, replica_groups=[2,4]<=[2,2,2]T(2,1,0), dimensions={0}
  %agd = bf16[8,4]{1,0} all-gather-done(%ags)
  %rs = f32[4]{0} reduce-scatter(%x), channel_id=3, replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'data'}, dimensions={0}, to_apply=%add
  %cp = f32[8]{0} collective-permute(%x), channel_id=4, source_target_pairs={{0,4},{4,0}}
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}
"""


def test_hlo_parser_reads_every_group_format_and_loop_counts():
    found = {c.name: c for c in hlo.collectives(SNIPPET, MESH)}
    assert found["ar"].axes == ("tensor",) and found["ar"].executions == 3
    assert found["ar"].bytes == 32
    assert found["ag"].axes == ("fsdp",) and found["ag"].bytes == 64
    # iota [2,4]<=[2,2,2]T(2,1,0): ids grouped by the last mesh coordinate -> data+fsdp
    assert found["agd"].kind == "all-gather" and found["agd"].axes == ("data", "fsdp")
    assert "ags" not in found  # an async pair counts once, at its done
    assert found["rs"].axes == ("data",) and found["rs"].bytes == 16 * 2
    assert found["cp"].axes == ("data",)
    summary = hlo.summarize(list(found.values()))
    assert summary[("tensor", "all-reduce")] == {"count": 3, "bytes": 96}


COND = """HloModule c

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%left (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %l = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
}

%right (q: f32[8]) -> f32[8] {
  %q = f32[8] parameter(0)
  ROOT %r = f32[8]{0} all-reduce(%q), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (i: s32[], x: f32[8]) -> f32[8] {
  %i = s32[] parameter(0)
  %x = f32[8] parameter(1)
  ROOT %c = f32[8] conditional(%i, %x, %x), branch_computations={%left, %right}
}
"""


def test_hlo_parser_reads_every_branch_of_a_conditional():
    found = {c.name: c for c in hlo.collectives(COND, MESH)}
    assert found["l"].axes == ("tensor",) and found["r"].axes == ("fsdp", "tensor")
    # Where the caller knows how often each branch runs (the pipeline's tick switch), its
    # collectives count that share of the executions.
    shared = {c.name: c for c in hlo.collectives(COND, MESH, {2: (0.25, 0.75)})}
    assert shared["l"].executions == 0.25 and shared["r"].executions == 0.75


def test_hlo_parser_reads_a_trip_count_from_the_loop_condition():
    # The TPU compiler prints no known_trip_count: a scan's condition compares its counter
    # against the trip count.
    cond = """%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %n = s32[]{:T(128)} constant(7)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""
    text = SNIPPET.replace(
        """%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}""",
        cond,
    ).replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    found = {c.name: c for c in hlo.collectives(text, MESH)}
    assert found["ar"].executions == 7
    # A condition of another form: counted once, as before.
    plain = SNIPPET.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    assert {c.name: c for c in hlo.collectives(plain, MESH)}["ar"].executions == 1


@pytest.mark.slow
def test_comm_and_bench_take_a_hugging_face_config_and_custom_sizes(tmp_path):
    """`comm` and `bench` build their model as `train` does: a local Hugging Face directory's
    config.json (its 32 positions become the sequence) or --model custom's size flags."""
    import json

    from tests.helpers import cli

    hf = tmp_path / "llama"
    hf.mkdir()
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_hidden_layers=2,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    (hf / "config.json").write_text(json.dumps(config))
    r = cli("comm", "--model", f"hf:{hf}", "--batch-size", "16", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["seq_len"] == 32
    # the default mesh's tensor axis splits its heads: partial sums compiled, and expected
    tensor = [
        row for row in report["rows"] if (row["axis"], row["kind"]) == ("tensor", "all-reduce")
    ]
    assert tensor and tensor[0]["bytes"] > 0 and tensor[0]["expected_bytes"] > 0
    sizes = ["--model", "custom", "--style", "gpt2", "--layers", "1", "--d-model", "64"]
    sizes += ["--heads", "4", "--d-mlp", "128", "--seq-len", "16", "--vocab", "256"]
    r = cli("bench", *sizes, "--steps", "1", "--warmup", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert (result["model"], result["seq_len"]) == ("custom", 16)
    r = cli("bench", "--model", "custom", "--style", "gpt2")
    assert r.returncode == 2 and "--model custom needs --layers" in r.stderr


# The replica groups' step on XLA:CPU (jax 0.11.2): the embedding table's gradient, a
# scatter-add XLA partitions itself, runs as an all-to-all over fsdp where the model expects
# jaxdist.kernels.lookup's reduce-scatter of the same 128 floats; a scalar's all-reduce that no
# model prices.
GROUPED = """HloModule g

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[2,64], y: f32[]) -> f32[2,64] {
  %x = f32[2,64] parameter(0)
  %y = f32[] parameter(1)
  %all-to-all.1 = (f32[1,64]{1,0}, f32[1,64]{1,0}) all-to-all(%x, %x), channel_id=1, \
replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'fsdp'}, \
metadata={op_name="jit(traced_step)/vmap(transpose(vmap(jvp())))/scatter-add"}
  %all-reduce.2 = f32[] all-reduce(%y), channel_id=2, \
replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'tensor'}, to_apply=%add, \
metadata={op_name="jit(traced_step)/vmap()/reduce_max"}
  ROOT %r = f32[2,64] copy(%x)
}
""".replace("\\\n", "")


def test_comm_explains_every_collective_its_model_does_not_expect():
    import io

    from rich.console import Console

    found = hlo.collectives(GROUPED, MESH)
    expected = {("fsdp", "reduce-scatter"): 512.0, ("data", "all-reduce"): 1024.0}
    rows = comm_report._rows(hlo.summarize(found), expected)
    rows = comm_report._explained(rows, comm_report._sources(GROUPED, found))
    by = {(r["axis"], r["kind"]): r for r in rows}
    # The reduce-scatter compiled as an all-to-all of its bytes: one row, beside its expectation.
    assert set(by) == {("fsdp", "all-to-all"), ("tensor", "all-reduce"), ("data", "all-reduce")}
    a2a = by[("fsdp", "all-to-all")]
    assert (a2a["bytes"], a2a["expected_bytes"], a2a["ratio"]) == (512, 512.0, 1.0)
    assert a2a["expected_kind"] == "reduce-scatter" and "embedding table" in a2a["note"]
    assert by[("tensor", "all-reduce")]["note"] == (
        "not in the layout's model: `reduce_max` in the forward pass"
    )
    assert by[("data", "all-reduce")]["note"] == "the model expects it; the program runs none"
    # As a script reads it: a readable title, names whole, each note on one line.
    console = Console(file=io.StringIO(), width=80)
    comm_report.print_table({"mesh": {"data": 2, "expert": 1, "fsdp": 2}, "rows": rows}, console)
    out = console.file.getvalue()
    assert "collectives per step on mesh data=2,fsdp=2 " in out and "{" not in out
    assert "│ all-to-all* │" in out and "…" not in out
    assert (
        "* tensor all-reduce: not in the layout's model: `reduce_max` in the forward pass\n" in out
    )


@pytest.mark.slow
def test_comm_on_a_replica_mesh_matches_its_model_or_says_why(capsys):
    """`jaxdist comm --mesh replica=2,fsdp=4`, as a script reads it: every collective beside
    its expectation (the embedding gradient's reduce-scatter, compiled as an all-to-all inside
    the groups, is that row) or explained in words; the title names the mesh as --mesh does."""
    from jaxdist.cli.main import main

    args = ["comm", "--devices", "cpu:8", "--mesh", "replica=2,fsdp=4", "--compile-cache", "off"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "collectives per step on mesh replica=2,fsdp=4 " in out and "{" not in out
    assert "unexpected" not in out and "…" not in out
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for r in report["rows"] + report["outer_rows"]:
        if r["bytes"] >= 1024:  # scalars' reductions aside, each as the model expects it
            assert r["ratio"] == pytest.approx(1.0, abs=0.05), r
        assert r["expected_bytes"] or "note" in r, r

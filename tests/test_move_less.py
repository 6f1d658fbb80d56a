"""Move less, fit by default: FSDP gradients reduce-scattered (never all-reduced whole and
sliced), counted in the compiled collectives of XLA's own TPU and GPU compilers; loop trips of
every counter form; `--remat auto` choosing the fastest policy that fits."""

import json

import pytest

from jaxdist.compiled import hlo
from jaxdist.planning import fit
from tests.extras import needs_gpu_aot, needs_tpu
from tests.helpers import cli

# A small Llama with the 7B's mechanisms (GQA-free attention, SwiGLU, untied head, a 32,000
# vocabulary): 4 layers, so a compile takes seconds. Weights: 4 x 12.6M + 2 x 32.8M = 116M.
SMALL_LLAMA = (
    "--model custom --style llama --layers 4 --d-model 1024 --heads 8 --d-mlp 2816 "
    "--seq-len 512 --vocab 32000"
).split()


# The embedding, [32000, 1024] in bf16 (65.5 MB): its gradient was summed whole until
# jaxdist.kernels.lookup reduce-scattered it; with fewer tokens a device than table rows (2
# rows of 512 here) the lookup is routed: neither the table nor its gradient moves, only the
# device's tokens' rows, an all-to-all each way.
TOKEN_ROWS_BF16 = 2 * 512 * 1024 * 2


def _compile(target: str, mesh: str, batch: int, *extra: str) -> dict:
    r = cli(
        "train",
        *SMALL_LLAMA,
        "--mesh",
        mesh,
        "--batch-size",
        str(batch),
        "--compile-only",
        "--json",
        "-",
        "--target",
        target,
        *extra,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _by_kind(report: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in report["collectives"]:
        out[c["kind"]] = out.get(c["kind"], 0.0) + c["bytes"]
    return out


@pytest.mark.slow
@needs_tpu
def test_tpu_fsdp_gradients_are_not_all_reduced_whole():
    report = _compile("tpu-v5p:2x2x2", "fsdp=8", 16, "--remat", "full")
    kinds = _by_kind(report)
    weights_bf16 = 2 * report["params"]
    # Before: every weight's bf16 gradient all-reduced whole (about the weights' bytes again)
    # and then sliced; later the embedding's and the head's still were. Now only the norm
    # scales and scalars are.
    assert kinds.get("all-reduce", 0) < 0.01 * weights_bf16, kinds
    # XLA's windowed matmuls: gathers and reductions as collective-permute rings.
    assert kinds.get("collective-permute", 0) > 0.5 * weights_bf16, kinds
    # One-way rings (jaxdist.parallel.collective_matmul) send what plain collectives would:
    # with full remat, the layers gathered for the forward and again for the backward, the
    # head (65.5 MB) once for both, every gradient reduce-scattered, each 7/8 of the weight
    # sent; the embedding routed (its rows' all-to-alls). XLA's two-way rings sent 1.95 times
    # this.
    layers_bf16 = 2 * 4 * (4 * 1024 * 1024 + 3 * 1024 * 2816)
    floor = 7 / 8 * (3 * layers_bf16 + 2 * 2 * 1024 * 32000) + 2 * TOKEN_ROWS_BF16
    sent = 7 / 8 * kinds["all-gather"] + kinds["collective-permute"] + kinds["all-to-all"]
    assert sent <= 1.01 * floor, (sent, floor)


@pytest.mark.slow
@needs_gpu_aot
def test_gpu_fsdp_gradients_are_reduce_scattered():
    report = _compile("h100:8", "fsdp=8", 16, "--remat", "full")
    kinds = _by_kind(report)
    weights_bf16 = 2 * report["params"]
    assert kinds.get("all-reduce", 0) < 0.01 * weights_bf16, kinds
    # Every layer weight's gradient reduce-scattered once (the full buffer counted, bf16):
    # 4 layers of 4*D*D + 3*D*F weights; the table's not at all (routed: forward and back).
    layers_bf16 = 2 * 4 * (4 * 1024 * 1024 + 3 * 1024 * 2816)
    assert kinds["reduce-scatter"] >= layers_bf16, kinds
    assert kinds["all-to-all"] == 2 * TOKEN_ROWS_BF16, kinds


# A study (two 1B compiles for TPU, about 2 min on CI's two cores): -m experiment. The suite
# keeps the choice (test_choose_*) and the refusal it reacts to (test_xla_refusals_*).
@pytest.mark.experiment
@needs_tpu
def test_remat_auto_takes_a_leaner_policy_when_the_batch_grows():
    # 4 rows per chip fit with every activation kept; 256 rows per chip do not (the planner
    # predicts about 181 GB without remat on a 95 GB chip), so auto must give some up.
    small = _compile("tpu-v5p:2x2x1", "fsdp=4", 16, "--seq-len", "2048")
    big = _compile("tpu-v5p:2x2x1", "fsdp=4", 1024, "--seq-len", "2048")
    assert small["remat"]["policy"] == "none" and small["fits"]
    assert big["remat"]["policy"] != "none" and big["fits"], big["remat"]


def test_choose_takes_the_fastest_policy_that_fits():
    peaks = {"none": 90e9, "dots": 40e9, "full": 20e9}
    # 50 GB TPU: 45 GB usable for a predicted peak (the one rule, jaxdist.planning.fit.fits).
    choice = fit.choose(("none", "dots", "full"), peaks.__getitem__, 50e9, "tpu")
    assert choice.policy == "dots" and choice.fits and list(choice.predicted) == ["none", "dots"]
    assert fit.next_policy(("none", "dots", "full"), choice.policy) == "full"
    assert fit.next_policy(("none", "dots", "full"), "full") is None
    assert fit.next_policy(("none", "dots", "full"), "offload") is None
    assert fit.choose(("none", "dots", "full"), peaks.__getitem__, 101e9, "tpu").policy == "none"


def test_choose_gives_the_leanest_marked_not_fitting_where_none_fits():
    peaks = {"none": 90e9, "full": 60e9}
    choice = fit.choose(("none", "full"), peaks.__getitem__, 40e9, "tpu")
    assert choice.policy == "full" and not choice.fits
    # The rule: a program's budget on the device (a TPU's whole figure, 90% of a GPU's),
    # less the memory model's 10% where the peak is predicted rather than compiled.
    assert fit.fits(62e9, 62e9, "tpu", predicted=False) and not fit.fits(62e9, 62e9, "gpu", False)
    assert fit.fits(0.9 * 62e9, 62e9, "tpu") and not fit.fits(0.9 * 62e9 + 1, 62e9, "tpu")
    assert fit.fits(0.81 * 62e9, 62e9, "gpu") and not fit.fits(0.82 * 62e9, 62e9, "gpu")


def test_xla_refusals_for_memory_are_recognised():
    tpu = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space"
    assert fit.refused_for_memory(RuntimeError(tpu))
    assert not fit.refused_for_memory(RuntimeError("INVALID_ARGUMENT: bad sharding"))


# A layer loop as the TPU compiler prints it once it proved the counter never negative: a u32
# counter, no known_trip_count. Its all-reduce runs 6 times a step.
U32_LOOP = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (u32[], f32[256])) -> (u32[], f32[256]) {
  %p = (u32[], f32[256]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[256] get-tuple-element(%p), index=1
  %r = f32[256] all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %one = u32[] constant(1)
  %j = u32[] add(%i, %one)
  ROOT %t = (u32[], f32[256]) tuple(%j, %r)
}

%cond (q: (u32[], f32[256])) -> pred[] {
  %q = (u32[], f32[256]) parameter(0)
  %k = u32[] get-tuple-element(%q), index=0
  %n = u32[] constant(6)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (x0: f32[256]) -> f32[256] {
  %x0 = f32[256] parameter(0)
  %zero = u32[] constant(0)
  %init = (u32[], f32[256]) tuple(%zero, %x0)
  %w = (u32[], f32[256]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[256] get-tuple-element(%w), index=1
}
"""


def test_loops_with_u32_counters_count_every_trip():
    found = hlo.collectives(U32_LOOP, {"data": 2})
    assert [(c.kind, c.executions, c.bytes) for c in found] == [("all-reduce", 6, 1024)]


# The TPU compiler's one-way windowed einsum: in the 6-trip loop above, a send skipped on the
# last trip by a predicated conditional (`counter + 1 < 6`): the ring's shards go 5 times.
ONE_WAY_RING = U32_LOOP.replace(
    """  %r = f32[256] all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %one = u32[] constant(1)
  %j = u32[] add(%i, %one)
""",
    """  %one = u32[] constant(1)
  %j = u32[] add(%i, %one)
  %last = u32[] constant(6)
  %more = pred[] compare(%j, %last), direction=LT
  %c = (f32[256]) conditional(%more, %x, %x), true_computation=%send, false_computation=%skip
  %r = f32[256] get-tuple-element(%c), index=0
""",
).replace(
    "%cond (",
    """%send (w: f32[256]) -> (f32[256]) {
  %w = f32[256] parameter(0)
  %cp = f32[256] collective-permute(%w), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (f32[256]) tuple(%cp)
}

%skip (v: f32[256]) -> (f32[256]) {
  %v = f32[256] parameter(0)
  ROOT %t = (f32[256]) tuple(%v)
}

%cond (""",
)


def test_a_ring_that_skips_its_last_send_counts_the_sends_it_makes():
    # Before, a predicated conditional's branches were not walked: the one-way ring's sends
    # were missing from every count (34.6 GB a step on Llama-2-7B at fsdp=8).
    found = hlo.collectives(ONE_WAY_RING, {"fsdp": 2})
    assert [(c.kind, c.executions) for c in found] == [("collective-permute", 5)]
    # The counter as the TPU compiler prints a loop it widened: the state's element `%p#0`.
    widened = ONE_WAY_RING.replace("%j = u32[] add(%i, %one)", "%j = u32[] add(%p#0, %one)")
    assert [c.executions for c in hlo.collectives(widened, {"fsdp": 2})] == [5]
    # A predicate of another form: its branch counted on every trip, an upper bound.
    other = ONE_WAY_RING.replace(
        "compare(%j, %last), direction=LT", "compare(%j, %last), direction=NE"
    )
    assert [c.executions for c in hlo.collectives(other, {"fsdp": 2})] == [6]


# XLA:TPU's reduce-scatter: an all-reduce in a fusion whose ROOT slices each chip's part out
# of it (as in the 405B step at fsdp=1024), which the TPU runs as a reduce-scatter.
REDUCE_SCATTER_FUSION = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter.3 (input: f32[512,64]) -> f32[256,64] {
  %input = f32[512,64] parameter(0)
  %all-reduce.7 = f32[512,64] all-reduce(%input), replica_groups={{0,1}}, to_apply=%add
  %pid = u32[] partition-id()
  %rows = u32[] constant(256)
  %start = u32[] multiply(%pid, %rows)
  %zero = u32[] constant(0)
  ROOT %ds = f32[256,64] dynamic-slice(%all-reduce.7, %start, %zero), dynamic_slice_sizes={256,64}
}

ENTRY %main (g: f32[512,64]) -> (f32[256,64], f32[512,64]) {
  %g = f32[512,64] parameter(0)
  %rs = f32[256,64] fusion(%g), kind=kCustom, calls=%all-reduce-scatter.3
  %ar = f32[512,64] all-reduce(%g), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (f32[256,64], f32[512,64]) tuple(%rs, %ar)
}
"""


def test_the_tpus_reduce_scatter_fusion_counts_as_a_reduce_scatter():
    # Counted as all-reduces before, the 405B's gradients at fsdp=1024 read as 101.5 GB of
    # whole-gradient all-reduce; the chips reduce-scatter them. A plain all-reduce stays one.
    found = {c.name: c for c in hlo.collectives(REDUCE_SCATTER_FUSION, {"fsdp": 2})}
    assert (found["all-reduce.7"].kind, found["all-reduce.7"].bytes) == ("reduce-scatter", 131072)
    assert found["ar"].kind == "all-reduce"


@pytest.mark.parametrize(
    "model, vocab",
    [
        # 300 ids, padded to 384 in the model: the loss covers the model's own 300.
        (["--model", "hf:tests/fixtures/hf/llama-gqa"], 300),
        (["--model", "tiny-llama", "--vocab", "1000"], 1000),
    ],
)
def test_a_compile_without_data_covers_the_models_own_vocabulary(model, vocab):
    # Before, the loss masked every logit past 256 (the byte vocabulary of the default data)
    # for whatever model was compiled.
    r = cli(
        "train", *model, "--mesh", "fsdp=8", "--batch-size", "8", "--compile-only", "--json", "-"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["loss_vocab"] == vocab


STREAMED = [
    # (hardware, mesh, remat, rings, streamed, more flags): the TPU compiler streams the layers
    # through windowed matmuls (planning.traffic.STREAMED_CHIPS) on all but the last; there the
    # batch also splits over `data`, so it gathers them whole, as the planner's plain rule has
    # it. One-way rings are jaxdist's (jaxdist.parallel.collective_matmul), two-way XLA's own.
    # The suite keeps the first; the others (a minute on CI's two cores) are -m experiment.
    ("v5p-16", "fsdp=8", "full", "one-way", True, ()),
    pytest.param("v5p-16", "fsdp=8", "full", "two-way", True, (), marks=pytest.mark.experiment),
    pytest.param(
        "v5p-16", "context=4,fsdp=2", "dots", "one-way", True, (), marks=pytest.mark.experiment
    ),
    pytest.param(
        "v5p-16", "context=4,fsdp=2", "dots", "two-way", True, (), marks=pytest.mark.experiment
    ),
    pytest.param(
        "v5p-32", "fsdp=8,tensor=2", "full", "one-way", True, (), marks=pytest.mark.experiment
    ),
    pytest.param(
        "v5p-16", "fsdp=4,data=2", "dots", "one-way", False, (), marks=pytest.mark.experiment
    ),
    # The unfused loss: its head's gradient streamed beside context (the fused one's is not).
    pytest.param(
        *("v5p-16", "context=4,fsdp=2", "dots", "one-way", True, ("--loss-chunk-tokens", "0")),
        marks=pytest.mark.experiment,
    ),
]


@needs_tpu
@pytest.mark.parametrize("hardware, mesh, remat, rings, streamed, more", STREAMED)
def test_planner_prices_the_tpu_compilers_streamed_weights(
    tmp_path, hardware, mesh, remat, rings, streamed, more
):
    # Priced as gathers, the first was 0.63 of the compiled bytes (Llama-2-7B at fsdp=8: 0.55).
    out = tmp_path / "plan.json"
    args = ["plan", *SMALL_LLAMA, "--hardware", hardware, "--mesh", mesh, "--remat", remat]
    args += ["--collective-matmul", rings, *more]
    r = cli(*args, "--batch-size", "16", "--verify", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["layouts"][0]
    v = row["verify"]
    assert v["platform"] == "tpu"
    assert abs(row["comm_bytes"] / v["hlo_collective_bytes"] - 1) <= 0.05, v
    gathers = "fsdp+context" if "context" in mesh else "fsdp"
    permuted = row["expected"].get(f"{gathers}|collective-permute", 0)
    # Streamed: n - 1 shards of 1/n per use one way (2n + 1 two-way), twice or three times a
    # step, so more than 0.8 of the layers' weights (bf16; half of them per device beside
    # tensor=2); besides them only the head's gradient is (the embedding, 2 rows of 512 a
    # device, is routed: all-to-alls).
    layers_bf16 = 2 * 4 * (4 * 1024 * 1024 + 3 * 1024 * 2816)
    assert (permuted > 0.8 * layers_bf16) == streamed, row["expected"]

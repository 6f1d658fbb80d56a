"""Context parallelism: the sequence split over `context`, attention exact across it by each
strategy, beside FSDP, data, tensor and pipeline axes; 3 steps equal the single-device run
(losses rtol 1e-5, first gradients and final weights), for plain rows and packed documents;
`jaxdist comm` and `plan` price the exchange; the balanced order balances; what cannot run is
refused before anything is compiled."""

import functools
import json

import jax
import numpy as np
import pytest

from jaxdist.config import DataConfig, OptimConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.inference.generate import check_unsplit
from jaxdist.layout import Layout, StepConfig
from jaxdist.optim import make_optimizer
from jaxdist.parallel import context
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import plan
from jaxdist.step import Vocab, build
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config
from models.transformer import Transformer
from tests.extras import needs_gpu_aot, needs_tpu
from tests.helpers import cli, mesh_for
from tests.test_equivalence import _assert_close, _first_gradients

# 3 steps of 256 tokens: the splash tests' single-device XLA runs need 256 (two of splash's
# 128-position blocks), and at the same length and steps they are the runs every test here
# compares with, compiled once for the module. Compiling is each run's cost, not its steps.
STEPS, ROWS, SEQ = 3, 8, 256
EOS = 10  # packed runs: about one token in eight opens a document
SLOW = pytest.mark.slow


@functools.cache
def _run(
    layout: str,
    strategy: str = "all-gather",
    packed: bool = True,
    model="tiny-llama",
    overrides=(),
    steps=STEPS,
):
    """`steps` steps (fp32) of ROWS rows of SEQ tokens: (losses, first gradients, final
    params, MoE auxiliary losses)."""
    mc = get_model_config(model, compute_dtype="float32", seq_len=SEQ, **dict(overrides))
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), steps)
    vocab = Vocab(mc.vocab_size, EOS if packed else None)
    mesh = mesh_for(layout)
    # a pipeline runs its schedule over 2 microbatches (the mean of means: the same step)
    step = StepConfig(microbatches=2 if "pipeline" in layout else 1, context_strategy=strategy)
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=ROWS, seq_len=mc.seq_len)
    jitted = build(lambda r: Transformer(mc, r), tx, lr, layout, mesh, vocab=vocab)
    data = TokenBatches(DataConfig(batch_size=ROWS), mc.seq_len, mc.vocab_size)
    state, losses, grads0, aux = jitted.init_fn(), [], None, []
    for s in range(steps):
        tokens = np.asarray(data.batch(s))
        if packed:  # documents of random lengths; row 0 stays one document
            opens = np.random.default_rng(s).random(tokens.shape) < 1 / 8
            tokens[1:] = np.where(opens[1:], EOS, tokens[1:])
        state, metrics = jitted.step_fn(state, jax.device_put(tokens, jitted.batch_sharding))
        losses.append(float(metrics["loss"]))
        aux.append(float(metrics.get("aux_loss", 0.0)))
        if s == 0:
            grads0 = _first_gradients(state, float(metrics["grad_norm"]))
    return losses, grads0, jax.device_get(state.params), aux


def _assert_matches(got, reference):
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5)
    assert got[0][-1] < got[0][0]  # it learns
    _assert_close(got[1], reference[1], rtol=1e-4, atol=1e-6)
    _assert_close(got[2], reference[2], rtol=1e-4, atol=1e-5)


LAYOUTS = ("context=4,fsdp=2", "context=2,data=2,tensor=2", "pipeline=2,context=2,data=2")


# The suite runs 4 of the 18 cases (compiling a layout's step is each case's cost): every
# layout, every strategy, packed documents and plain rows each at least once, and the ring
# both as permutes (context=4,fsdp=2) and as all-gathers inside pipeline stages
# (context.carrier). All-gather over packed documents is checked against one device too, by
# test_learned_positions_travel_with_the_tokens and, inside a pipeline, by
# test_experts_beside_context_route_each_devices_own_tokens. The other 14 are a study
# (-m experiment). The quick loop keeps one: ring (the most machinery) over packed documents.
SUITE = {
    ("context=2,data=2,tensor=2", "all-gather", False),
    ("pipeline=2,context=2,data=2", "ulysses", True),
    ("pipeline=2,context=2,data=2", "ring", False),
}


def _marks(layout: str, strategy: str, packed: bool):
    if (layout, strategy, packed) == ("context=4,fsdp=2", "ring", True):
        return ()
    return SLOW if (layout, strategy, packed) in SUITE else pytest.mark.experiment


CASES = [
    pytest.param(layout, strategy, packed, marks=_marks(layout, strategy, packed))
    for layout in LAYOUTS
    for strategy in context.STRATEGIES
    # plain rows (no document ids: zeros inside attention) and packed documents
    for packed in (True, False)
]


@pytest.mark.parametrize("layout,strategy,packed", CASES)
def test_context_parallel_step_equals_single_device(layout, strategy, packed):
    _assert_matches(_run(layout, strategy, packed), _run("single", packed=packed))


@SLOW
def test_learned_positions_travel_with_the_tokens():
    # GPT-2 style: positions index a learned table, so a token placed on the wrong position
    # would change the loss.
    reference = _run("single", model="tiny")
    _assert_matches(_run("context=4,fsdp=2", "all-gather", model="tiny"), reference)


# -m experiment (a minute: two MoE runs and a pipelined pair), for the suite's time; the suite
# keeps experts beside context in test_replica's M = 1 case and test_comm_rows_... below.
@pytest.mark.experiment
def test_experts_beside_context_route_each_devices_own_tokens():
    # Dropless, so no token's fate depends on where it sits. Each device routes its own part
    # of the sequence (test_comm_rows_...: no gather of it into the layer, all-to-alls of the
    # local tokens only). Inside a pipeline the balance and z-losses are means over the whole
    # sequence, as in the same pipeline without the split (microbatched, so not the flat run).
    # A receive buffer that holds every row 2 expert devices can send: none dropped.
    moe = {"model": "tiny-moe", "overrides": (("moe_buffer_factor", 2.0),)}
    _assert_matches(_run("context=2,expert=2,fsdp=2", **moe), _run("single", **moe))
    piped = _run("pipeline=2,context=2,expert=2", **moe)
    unsplit = _run("pipeline=2,expert=2,data=2", **moe)
    assert min(piped[3]) > 0
    np.testing.assert_allclose(piped[3], unsplit[3], rtol=1e-6)
    _assert_matches(piped, unsplit)


# Both strategies the kernel runs under and both kinds of rows once each in the suite; Ulysses
# over packed documents (its kernel gets the document ids as all-gather's does) is a study.
@SLOW
@pytest.mark.parametrize(
    "strategy,packed",
    [
        ("all-gather", True),
        pytest.param("ulysses", True, marks=pytest.mark.experiment),
        ("ulysses", False),
    ],
)
def test_splash_attention_across_context_equals_xla_on_one_device(strategy, packed):
    # TPU's kernel (Pallas interpret mode here). All-gather: one kernel for the whole balanced
    # mask, its block tables split over the query shards; packed documents' ids gathered with
    # K/V. Ulysses: after the all-to-all, the whole sequence put back in row order for the
    # kernel each device runs without a split (causal, document ids), and back.
    # The reference is test_context_parallel_step_equals_single_device's (the same call).
    reference = _run("single", packed=packed)
    got = _run("context=2,fsdp=2,tensor=2", strategy, packed, overrides=(("attention", "splash"),))
    _assert_matches(got, reference)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_order_gives_each_device_equal_causal_work(cp):
    T = 64 * cp
    order = context.balanced_order(T, cp)
    assert sorted(order) == list(range(T))
    per_device = order.reshape(cp, T // cp)
    c = T // (2 * cp)
    for i, held in enumerate(per_device):  # chunks i and 2cp-1-i, in order
        expect = [*range(i * c, (i + 1) * c), *range((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
        assert list(held) == expect
    # Causal work: the keys each query sees (its place + 1), summed over a device's tokens.
    work = (per_device + 1).sum(axis=1)
    assert work.max() == work.min()
    naive = (np.arange(T).reshape(cp, T // cp) + 1).sum(axis=1)
    assert naive.max() / naive.min() > 2 * cp - 2  # what the order removes


def _build(layout, seq_len=128, **step):
    mc = get_model_config("tiny-llama")
    tx, lr = make_optimizer(OptimConfig(), 10)
    mesh = mesh_for(layout)
    at = Layout.on(mesh, STANDARD_RULES, StepConfig(**step), batch_size=ROWS, seq_len=seq_len)
    return build(lambda r: Transformer(mc, r), tx, lr, at, mesh, vocab=Vocab(mc.vocab_size, None))


def test_layouts_it_cannot_run_are_refused_before_compiling():
    with pytest.raises(ConfigError, match=r"--seq-len 100 is not a multiple of 8: use .* 96"):
        _build("context=4,fsdp=2", seq_len=100)
    with pytest.raises(ConfigError, match="--context-strategy 'tree': choose from all-gather"):
        _build("context=4,fsdp=2", context_strategy="tree")
    with pytest.raises(ConfigError, match="generation does not split the sequence over context"):
        check_unsplit(STANDARD_RULES, {"context": 4, "fsdp": 2})
    check_unsplit(STANDARD_RULES, {"fsdp": 8, "context": 1})  # no split: generation runs
    with pytest.raises(
        # the plan names the same fix as the step (one check: jaxdist.layout.Layout.problems)
        ConfigError,
        match=r"fsdp=2,context=4 cannot run .*--seq-len 100 .*use --seq-len 96",
    ):
        model = plan_model(get_model_config("tiny-llama", seq_len=100))
        plan(model, STANDARD_RULES, PlanConfig(8, "h100", 8, mesh=(("context", 4), ("fsdp", 2))))


@SLOW
@needs_tpu
def test_ring_in_pipeline_stages_permutes_on_tpu():
    # On CPU the hops are all-gathers (context.carrier, tested above for the values); the TPU
    # compiler takes the permutes inside the stage's tick. Splash inside the pipeline is refused
    # naming --attention xla, which must exist and run.
    args = ["train", "--model", "tiny-llama", "--mesh", "pipeline=2,context=2,data=2"]
    args += ["--context-strategy", "ring", "--microbatches", "2", "--batch-size", "8"]
    args += ["--compile-only", "--target", "tpu-v5p:2x2x2", "--json", "-"]
    refused = cli(*args)
    assert refused.returncode != 0 and "add --attention xla" in refused.stderr
    r = cli(*args, "--attention", "xla")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    hops = [c for c in report["collectives"] if c["kind"] == "collective-permute"]
    assert any(c["axis"] == "context" and c["count"] >= 2 for c in hops), report["collectives"]


@SLOW
@pytest.mark.parametrize(
    "target",
    [pytest.param("tpu-v5p:2x2x2", marks=needs_tpu), pytest.param("h100:8", marks=needs_gpu_aot)],
)
def test_ulysses_runs_the_platforms_fused_kernel(target):
    # After its all-to-all each device holds the whole sequence for a share of the heads: the
    # kernel it runs without a split (splash, cuDNN), not XLA's [T, T] scores per head shard.
    args = ["train", "--model", "tiny-llama", "--seq-len", "512", "--batch-size", "2"]
    args += ["--mesh", "context=4,fsdp=2", "--context-strategy", "ulysses"]
    r = cli(*args, "--compile-only", "--target", target, "--json", "-")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    kernels = report["kernels"]
    fused = kernels["attention"]
    if target.startswith("tpu"):  # splash's forward, dq and dkv kernels
        assert fused["tpu_custom_calls"] >= 3, fused
    else:
        assert 1 <= fused["cudnn_fused_forward"] <= fused["cudnn_fused_backward"], fused
    assert kernels["score_tensors"] == 0  # no [.., 512, 512] fp32 value in the program
    exchanged = {(c["axis"], c["kind"]) for c in report["collectives"]}
    assert ("context", "all-to-all") in exchanged, report["collectives"]


def test_ulysses_refuses_heads_that_do_not_divide():
    # tiny-llama: 4 query heads, 2 per tensor shard on tensor=2; context=4 cannot split 2.
    # Refused while the step is traced: for abstract state and tokens, so no init is compiled.
    jitted = _build("context=4,tensor=2", context_strategy="ulysses")
    with pytest.raises(ConfigError, match="2 query heads per tensor shard do not divide"):
        jitted.compile_abstract()


# The suite prices 5 of the 8 (each compiles a layout's step): every layout, every strategy,
# the ring's hops as all-gathers inside stages, experts beside context. Ring and Ulysses on
# context=4,fsdp=2 are priced against the compiled step by
# test_plan_prices_a_context_split_as_the_compiler_builds_it as well, and a pipeline's stage
# weights moved over context by its Ulysses and ring cases, so those three are a study
# (-m experiment).
COMM = [
    pytest.param(layout, strategy, model, marks=marks)
    for layout, strategy, model, marks in (
        ("context=4,fsdp=2", "all-gather", "tiny-llama", ()),
        ("context=4,fsdp=2", "ring", "tiny-llama", pytest.mark.experiment),
        ("context=4,fsdp=2", "ulysses", "tiny-llama", pytest.mark.experiment),
        ("context=2,data=2,tensor=2", "all-gather", "tiny-llama", SLOW),
        ("pipeline=2,context=2,data=2", "all-gather", "tiny-llama", pytest.mark.experiment),
        ("pipeline=2,context=2,data=2", "ulysses", "tiny-llama", SLOW),
        # on CPU inside stages the ring's hops are all-gathers (context.carrier)
        ("pipeline=2,context=2,data=2", "ring", "tiny-llama", SLOW),
        ("context=2,expert=2,fsdp=2", "all-gather", "tiny-moe", SLOW),
    )
]


@pytest.mark.parametrize("layout,strategy,model", COMM)
def test_comm_rows_match_the_expected_exchange(layout, strategy, model, capsys):
    """`jaxdist comm`: each strategy's own collective over `context` (K/V all-gathers and their
    gradients' reduce-scatters; ring permutes; Ulysses all-to-alls), the weights' gradients
    summed over `context` too and, in a pipeline, stage weights moved once per step over it,
    within 5% of what traffic.expected prices. MoE: the experts' all-to-alls carry each
    device's own part of the sequence (a gathered one would double them and the K/V gathers)."""
    import json

    from jaxdist.cli.main import main

    args = ["comm", "--model", model, "--mesh", layout, "--batch-size", str(ROWS)]
    args += ["--context-strategy", strategy, "--json"]
    args += ["--moe-buffer-factor", "2"] if "moe" in model else []
    args += ["--microbatches", "2"] if "pipeline" in layout else []
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["axis"], r["kind"]): r for r in rep["rows"]}
    own = {"all-gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}
    own["ring"] = "all-gather" if "pipeline" in layout else own["ring"]
    assert rows[("context", own[strategy])]["bytes"] > 0
    total = sum(r["bytes"] for r in rep["rows"])
    # Rows of a few kB (norm scales, the router's statistics and gradient) are priced too, but
    # XLA groups them by layout in ways the model does not follow row by row: together they
    # must stay within 1% of the step's bytes, and every larger row within 5%.
    small = [r for r in rep["rows"] if max(r["bytes"], r["expected_bytes"]) < 0.005 * total]
    for r in rep["rows"]:
        if r["expected_bytes"] and r not in small:
            assert r["ratio"] == pytest.approx(1.0, abs=0.05), r
    # Left out: the tokens' places and document ids, gathered once ([T] and [B, T] int32), and
    # scalar reductions (the loss).
    off = sum(abs(r["bytes"] - r["expected_bytes"]) for r in rep["rows"] if r in small)
    unexpected = sum(r["bytes"] for r in rep["rows"] if not r["expected_bytes"] and r not in small)
    assert off + unexpected < 0.01 * total, rep["rows"]


@pytest.mark.parametrize(
    "strategy",
    ["all-gather", pytest.param("ring", marks=SLOW), pytest.param("ulysses", marks=SLOW)],
)
def test_plan_prices_a_context_split_as_the_compiler_builds_it(tmp_path, capsys, strategy):
    """`plan --axes fsdp,context --verify`: memory within 15% and collective bytes within 5% of
    the compiled step (XLA's CPU compiler, 8 fake devices), each strategy's exchange priced."""
    import json

    from jaxdist.cli.main import main

    out = tmp_path / "plan.json"
    args = ["plan", "--model", "tiny-llama", "--devices", "8", "--hardware", "cpu"]
    args += ["--batch-size", "8", "--mesh", "context=4,fsdp=2", "--context-strategy", strategy]
    assert main([*args, "--verify", "1", "--json", str(out)]) == 0
    assert "every verified layout within" in capsys.readouterr().out
    row = json.loads(out.read_text())["layouts"][0]
    assert row["mesh"]["context"] == 4
    own = {"all-gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}
    assert row["expected"][f"context|{own[strategy]}"] > 0
    v = row["verify"]
    assert abs(row["memory_bytes"]["peak"] / v["xla_peak_bytes"] - 1) <= 0.15, v
    assert abs(row["comm_bytes"] / v["hlo_collective_bytes"] - 1) <= 0.05, v


def test_the_default_plan_splits_the_sequence_only_where_it_pays(tmp_path, capsys):
    """`plan` searches `context` by default: 2 rows of 32K on 8 v5p chips (a batch that does not
    split 8 ways) rank a context split first; 32 rows of 4K on 8 H100s rank none first."""
    import json

    from jaxdist.cli.main import main

    def best(*args: str) -> dict:
        out = tmp_path / "plan.json"
        assert (
            main(["plan", "--model", "llama2-7b", "--devices", "8", *args, "--json", str(out)]) == 0
        )
        return json.loads(out.read_text())["layouts"][0]["mesh"]

    assert best("--hardware", "v5p-16", "--seq-len", "32768", "--batch-size", "2")["context"] > 1
    assert best("--hardware", "h100", "--seq-len", "4096", "--batch-size", "32")["context"] == 1

"""`jaxdist plan` for the models and fleets users bring: Google Cloud slice names, a Hugging Face
config or custom sizes, one given layout, groups across hosts, and the absolute step time
against published runs (experiments/calibration.py prints the same rows)."""

import json

import pytest

from jaxdist.cli.main import main
from jaxdist.compiled.tpu import parse_target
from jaxdist.errors import ConfigError
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import plan
from meshes.presets import STANDARD_RULES
from tests.helpers import planned as _model


def test_google_cloud_slice_names(capsys):
    """Google Cloud counts v4 and v5p TensorCores (2 per chip), v5e and v6e chips."""
    from jaxdist.hardware import cloud_slice, get_hardware
    from meshes.presets import get_mesh_preset

    assert cloud_slice("v5p-16") == ("v5p", 8)
    assert cloud_slice("v5e-256") == ("v5e", 256)
    assert cloud_slice("v5litepod-16") == ("v5e", 16)
    assert cloud_slice("v6e-8") == ("v6e", 8)
    assert cloud_slice("v4-8") == ("v4", 4)
    assert parse_target("v5p-16") == "v5p:2x2x2" == parse_target("tpu-v5p:2x2x2")
    assert get_hardware("v5p-16").devices_per_host == 8  # the slice is the ICI domain
    for bad, hint in (("v5p-24", "v5p-16 is 8 chips"), ("v5p-7", "2 per chip")):
        with pytest.raises(ConfigError, match=hint):
            cloud_slice(bad)
    # jaxdist's old chip-counting names contradict Google's: refused, naming the new one.
    with pytest.raises(ConfigError, match="v5p-128: write that instead"):
        parse_target("tpu-v5p-64")
    with pytest.raises(ConfigError, match="is now 'v5p-16'"):
        get_mesh_preset("tpu-v5p-8")
    assert main(["plan", "--model", "tiny", "--hardware", "v5p-16", "--batch-size", "64"]) == 0
    assert capsys.readouterr().out.startswith("v5p-16: 8 chips")
    assert main(["plan", "--model", "tiny", "--hardware", "v6e-8", "--devices", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "contradicts --hardware v6e-8 (v6e-8 is 8 chips)" in err and "\n" not in err
    assert main(["plan", "--model", "tiny", "--hardware", "mi300x-8"]) == 2
    assert "unknown hardware 'mi300x-8'" in capsys.readouterr().err


def test_cloud_gpu_machine_types_bring_their_own_network(tmp_path, capsys):
    """a3-highgpu-8g is 8 H100s whose hosts talk over GPUDirect-TCPX at what NCCL was measured
    to get through it, an eighth of the InfiniBand the bare h100 preset assumes: the same
    layout prices the same inside one host and slower across hosts, and the plan says which
    machine it priced."""
    from jaxdist.hardware import get_hardware

    a3 = get_hardware("a3-highgpu-8g")
    assert (a3.name, a3.machine, a3.outer.bandwidth) == ("h100", "a3-highgpu-8g", 6.25e9)
    assert a3.kinds == () and a3.platform == "gpu"  # a running job still finds plain h100
    assert get_hardware("Standard_ND96isr_H100_v5").outer.bandwidth == 50e9  # Azure's casing
    assert get_hardware("p4d.24xlarge").memory_bytes == 40e9  # the 40 GB A100s

    def step(hardware: str, layout: tuple) -> float:
        devices = 1
        for _, n in layout:
            devices *= n
        cfg = PlanConfig(devices, hardware, 4 * devices, mesh=layout)
        return plan(_model("llama2-7b", remat="dots"), STANDARD_RULES, cfg)["layouts"][0]["step_s"]

    one_host = (("fsdp", 8),)
    assert step("a3-highgpu-8g", one_host) == step("h100", one_host)
    two_hosts = (("data", 2), ("fsdp", 8))
    assert step("a3-highgpu-8g", two_hosts) > step("a3-megagpu-8g", two_hosts)
    assert step("a3-megagpu-8g", two_hosts) > step("p5.48xlarge", two_hosts)
    assert step("p5.48xlarge", two_hosts) == step("h100", two_hosts)
    args = ["plan", "--model", "tiny", "--hardware", "a3-highgpu-8g", "--devices", "16"]
    assert main([*args, "--batch-size", "64", "--top", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "a3-highgpu-8g: 8 H100 per host, 2 hosts, 6.25 GB/s per GPU between them"
    assert main(["plan", "--model", "tiny", "--hardware", "a3-highgpu-4g"]) == 2
    assert "a cloud GPU machine type (a3-highgpu-8g, " in capsys.readouterr().err


def test_plan_a_hugging_face_config_and_a_custom_model(tmp_path, capsys):
    """Llama-3.1-8B's config.json sizes; its 8,030,261,248 parameters are Meta's figure."""
    model = tmp_path / "llama"
    model.mkdir()
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    args = ["plan", "--model", f"hf:{model}", "--seq-len", "8192", "--hardware", "h100"]
    args += ["--devices", "8", "--mesh", "fsdp=8", "--batch-size", "8", "--remat", "dots"]
    args += ["--json", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    best = json.loads(out.read_text())["layouts"][0]
    # fp32 parameters, all of them split 8 ways by FSDP
    assert best["memory_bytes"]["params"] * 8 == pytest.approx(4 * 8_030_261_248, rel=2e-3)
    # --model custom with the size flags: tiny-llama's sizes, counted by hand: per layer QKV
    # 128 x (4 + 2 + 2) x 32, output 4 x 32 x 128, MLP 3 x 128 x 384, 2 norms of 128;
    # embedding and head 256 x 128 each, final norm 128.
    custom = ["--model", "custom", "--style", "llama", "--layers", "2", "--d-model", "128"]
    custom += ["--heads", "4", "--kv-heads", "2", "--d-mlp", "384", "--seq-len", "128"]
    custom += ["--vocab", "256", "--hardware", "cpu", "--devices", "8", "--mesh", "data=8"]
    assert main(["plan", *custom, "--batch-size", "16", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["layouts"][0]
    per_layer = 128 * 8 * 32 + 4 * 32 * 128 + 3 * 128 * 384 + 2 * 128
    assert row["memory_bytes"]["params"] == 4 * (2 * per_layer + 2 * 256 * 128 + 128)
    capsys.readouterr()
    assert main(["plan", "--model", "custom", "--style", "llama", "--layers", "2"]) == 2
    assert "--model custom needs --d-model" in capsys.readouterr().err


def test_plan_prices_one_given_layout(tmp_path, capsys):
    ranked = plan(_model("tiny", "float32"), STANDARD_RULES, PlanConfig(8, "cpu", 64))
    wanted = next(r for r in ranked["layouts"] if r["layout"] == "fsdp=4,tensor=2")
    out = tmp_path / "one.json"
    args = ["plan", "--model", "tiny", "--hardware", "cpu", "--devices", "8", "--batch-size"]
    args += ["64", "--mesh", "fsdp=4,tensor=2", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["considered"] == 1 and len(result["layouts"]) == 1
    # The same price the ranking gave that layout among the others.
    assert result["layouts"][0]["step_s"] == pytest.approx(wanted["step_s"], rel=1e-12)
    capsys.readouterr()
    assert main([*args[:-4], "--mesh", "fsdp=4"]) == 2
    assert "spans 4 devices, not --devices 8" in capsys.readouterr().err


def test_a_group_across_hosts_runs_in_two_levels():
    """An all-reduce over 16 H100s (2 hosts): reduce-scatter over the 8 in each host, an
    all-reduce of an eighth across the 2 hosts, an all-gather inside: worked by hand."""
    from jaxdist.hardware import get_hardware
    from jaxdist.planning.costmodel import spanning_time

    hw = get_hardware("h100")
    a_in, b_in, a_out, b_out = 15e-6, 370e9, 30e-6, 50e9  # hardware.toml [h100]
    n = 1e9
    inside = 2 * (7 * a_in + 7 / 8 * n / b_in)
    across = 2 * a_out + 2 * (1 / 2) * (n / 8) / b_out
    assert spanning_time("all-reduce", n, 16, 1, hw) == pytest.approx(inside + across)
    # A group inside one host stays on NVLink.
    assert spanning_time("all-reduce", n, 8, 1, hw) == pytest.approx(14 * a_in + 14 / 8 * n / b_in)


def _maxtext_flops_per_token(layers, d, heads, kv, mlp, vocab, seq):
    """MaxText's count (maxtext_utils.calculate_tflops_training_per_device as of these runs):
    3 x 2 FLOPs per weight of the MLP (3 matmuls), QKV, output and head; attention
    3 x 4 T H d_head per layer, no causal halving."""
    hd = d // heads
    layer = 2 * 3 * mlp * d + 2 * d * (heads + 2 * kv) * hd + 2 * d * heads * hd
    return 3 * (layers * layer + 2 * d * vocab) + 3 * 4 * seq * heads * hd * layers


CALIBRATION = [
    # MaxText configs/a3/llama_2_7b/README.md, 1x A3: 492 TFLOP/s per H100; 1vm.sh: FSDP 8,
    # 4 rows of 4096 per GPU, remat minimal_flash (matmul and attention outputs kept).
    (
        dict(style="llama", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=32),
        dict(d_mlp=11008, vocab_size=32000, seq_len=4096, remat="dots"),
        "h100",
        32,
        _maxtext_flops_per_token(32, 4096, 32, 32, 11008, 32000, 4096) * 4 * 4096 / 492e12,
        (0.0, False),
    ),
    # llm-foundry scripts/train/benchmarking/README.md, H100 BF16, MPT-1B seq 2048 on 8 GPUs,
    # micro-batch 14, no activation checkpointing: 45,455 tokens/s per GPU.
    (
        dict(style="gpt2", num_layers=24, d_model=2048, num_heads=16, num_kv_heads=16),
        dict(d_mlp=8192, vocab_size=50368, seq_len=2048, tie_embeddings=True),
        "h100",
        112,
        14 * 2048 / 45455,
        (0.0, False),
    ),
    # tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-8: 3.443 s per step of 196,608
    # tokens, FSDP 8; remat custom: the MLP and attention recomputed, projections offloaded:
    # the MLP's 3 x 4096 x 14336 of a layer's 4096 x (32 + 16) x 128 + 32 x 128 x 4096 more.
    (
        dict(style="llama", num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8),
        dict(d_mlp=14336, vocab_size=128256, seq_len=8192, remat="dots"),
        "v6e-8",
        24,
        3.443,
        (176_160_768 / (176_160_768 + 25_165_824 + 16_777_216), True),
    ),
]


@pytest.mark.parametrize("sizes,more,hardware,batch,published_s,rerun", CALIBRATION)
def test_absolute_step_time_within_10_percent_of_published_runs(
    sizes, more, hardware, batch, published_s, rerun
):
    import dataclasses

    model = _model("custom", **sizes, **more)
    share, attention = rerun
    model = dataclasses.replace(model, recompute_matmul=share, recompute_attention=attention)
    cfg = PlanConfig(8, hardware, batch, mesh=(("fsdp", 8),))
    row = plan(model, STANDARD_RULES, cfg)["layouts"][0]
    assert row["step_s"] == pytest.approx(published_s, rel=0.10)


def test_remat_full_is_priced_as_a_second_forward(tmp_path):
    """tiny (see test_two_layouts_worked_on_paper): 2,949,120 training FLOPs per token. Full
    remat reruns each layer's forward: 2 x its 393,216 matmul weights (QKV 98,304, output
    32,768, MLP 2 x 131,072; the head's 32,768 is outside the layers) plus attention's forward,
    a third of 12 L D T = 393,216. dots reruns no weight matmul, but on CPU XLA's unfused
    attention (batched matmuls, which dots does not save) is rerun."""
    compute = {}
    for remat in ("none", "dots", "full"):
        out = tmp_path / f"{remat}.json"
        args = ["plan", "--model", "tiny", "--hardware", "cpu", "--devices", "8", "--mesh"]
        args += ["data=8", "--batch-size", "16", "--compute-efficiency", "0.5", "--remat", remat]
        assert main([*args, "--json", str(out)]) == 0
        compute[remat] = json.loads(out.read_text())["layouts"][0]["compute_s"]
    attention = 393_216 / 3
    assert compute["dots"] / compute["none"] == pytest.approx((2_949_120 + attention) / 2_949_120)
    extra = 2 * 393_216 + attention
    assert compute["full"] / compute["none"] == pytest.approx((2_949_120 + extra) / 2_949_120)


def test_a_plan_a_person_can_act_on(tmp_path, capsys, monkeypatch):
    """A GPT-2 config.json alone is planned (no weights needed for an architecture); the plan
    says the sequence length it priced, fits 100 columns with nothing cut, and prints (and
    --json holds) the exact train command of its first choice, microbatches and remat
    included, which parses as `jaxdist train` takes it."""
    import shlex
    import shutil

    from jaxdist.cli import cmd_train

    model = tmp_path / "gpt2"
    model.mkdir()
    shutil.copy("tests/fixtures/hf/gpt2/config.json", model / "config.json")
    monkeypatch.setenv("COLUMNS", "100")
    out = tmp_path / "plan.json"
    args = ["plan", "--model", f"hf:{model}", "--hardware", "v5p-16", "--batch-size", "64"]
    assert main([*args, "--axes", "pipeline,fsdp", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    best = result["layouts"][0]
    # The table fits 100 columns; to a pipe (as here) its notes are whole lines, unwrapped.
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    table = lines[head : next(i for i in range(head, len(lines)) if lines[i].startswith("mb: "))]
    assert all(len(line) <= 100 for line in table), max(map(len, table))
    assert "…" not in printed  # rich's ellipsis: no cell was cut
    for row in result["layouts"]:
        assert row["layout"] in printed
    assert f"rows of {result['seq_len']:,} tokens (--seq-len)" in printed
    command = result["command"]
    assert command in printed and command.startswith("jaxdist train --model hf:")
    argv = shlex.split(command)[1:]
    for flag, value in (("--mesh", best["layout"]), ("--remat", best["remat"])):
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--microbatches") + 1] == str(best["microbatches"])
    assert argv[argv.index("--seq-len") + 1] == str(result["seq_len"])
    import tyro

    parsed = tyro.cli(cmd_train.Train, args=argv[1:])
    assert isinstance(parsed, cmd_train.Train) and parsed.step.microbatches == best["microbatches"]
    assert "check it from this host: add --compile-only --target v5p-16" in printed


def test_json_dash_is_the_plan_alone_on_stdout(tmp_path, capsys, monkeypatch):
    """`plan --json -` prints the plan as JSON and nothing else, as `train --compile-only
    --json -` does, and writes no file named `-` (it once did, into the working directory)."""
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model", "tiny", "--hardware", "v5p-16", "--batch-size", "64"]
    assert main([*argv, "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layouts"] and result["command"].startswith("jaxdist train ")
    assert not (tmp_path / "-").exists()

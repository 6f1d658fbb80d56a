"""The training loop in plain PyTorch: the outside reference jaxdist's whole loop is tested
against (tests/test_torch_parity.py). Run it with a Python that has torch and transformers:

    python tests/torch_reference/train_llama.py MODEL_DIR BATCHES.npy --lr 3e-3 ...

MODEL_DIR is a Hugging Face model directory (LlamaForCausalLM, loaded in fp32); BATCHES.npy
holds int tokens [steps, batch, seq_len + 1], the batch of each step (inputs are a row's first
seq_len tokens, targets its last). Each step is one full-batch forward and backward, global-norm
clipping (torch.nn.utils.clip_grad_norm_), torch.optim.AdamW with weight decay on the weight
matrices only (every parameter of two or more dimensions; norms stay undecayed), and the
learning rate of transformers' warmup-then-cosine schedule (a LambdaLR stepped once per
update). With --eos-id, rows are packed documents that each EOS opens: attention stays inside
a document (a 4D mask) and positions restart at each (position_ids); a row's leading partial
document starts at position 0. Prints one JSON line: per step the loss, the gradient norm
before clipping and the learning rate the update used.

With --replicas M (DiLoCo, jaxdist's `replica` mesh axis; tests/test_torch_diloco.py) the loop
trains M copies of the model (copy.deepcopy), each with its own AdamW and LambdaLR, copy r on
rows r*B/M .. (r+1)*B/M - 1 of every batch, clipped on its own gradient. After every
--sync-every H-th step (0-based steps s with (s + 1) % H == 0) the outer step: the outer
weights' gradient is set to outer - mean over copies of the copies' weights, a
torch.optim.SGD(lr=--outer-lr, momentum=--outer-momentum, nesterov=True) steps them, and every
copy takes the new outer weights (their AdamW states stay). The loss, gradient norm and
learning rate printed are the means over the copies. M = 1 (the default) is the plain loop.
"""

import argparse
import copy
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup


def documents(inputs: np.ndarray, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [B, 1, T, T] boolean mask (True: may attend) and [B, T] positions of packed rows."""
    B, T = inputs.shape
    segment = np.cumsum(inputs == eos_id, axis=1)
    positions = np.zeros((B, T), np.int64)
    for b in range(B):
        start = 0
        for t in range(T):
            if inputs[b, t] == eos_id:
                start = t
            positions[b, t] = t - start
    causal = np.tril(np.ones((T, T), bool))
    same = segment[:, :, None] == segment[:, None, :]
    mask = (same & causal)[:, None]
    return torch.from_numpy(mask), torch.from_numpy(positions)


def adamw(model: torch.nn.Module, args: argparse.Namespace):
    """AdamW with decay on the weight matrices only, and its warmup-cosine LambdaLR."""
    decayed = [q for q in model.parameters() if q.ndim >= 2]
    undecayed = [q for q in model.parameters() if q.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": args.weight_decay},
            {"params": undecayed, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.b1, args.b2),
        eps=args.eps,
        foreach=False,
    )
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, args.warmup_steps, args.total_steps, min_lr_rate=args.min_lr_ratio
    )
    return optimizer, scheduler


def train_step(model, optimizer, scheduler, tokens: np.ndarray, args) -> tuple[float, ...]:
    """One update on `tokens` [b, seq_len + 1]: (loss, gradient norm before clipping, the
    learning rate the update used)."""
    inputs, targets = tokens[:, :-1], torch.from_numpy(tokens[:, 1:])
    kwargs = {}
    if args.eos_id is not None:
        kwargs["attention_mask"], kwargs["position_ids"] = documents(inputs, args.eos_id)
    logits = model(input_ids=torch.from_numpy(inputs), **kwargs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # max_norm inf: the norm alone (--clip 0, as jaxdist's flag, means no clipping)
    limit = args.clip if args.clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit, foreach=False)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return loss.item(), norm.item(), lr


def outer_step(outer: list[torch.nn.Parameter], optimizer, groups: list[torch.nn.Module]) -> None:
    """DiLoCo's outer step: `optimizer` (SGD over `outer`) steps on outer - mean of the
    groups' weights as the gradient; then every group starts from the new outer weights."""
    with torch.no_grad():
        weights = [list(g.parameters()) for g in groups]
        for p, *copies in zip(outer, *weights, strict=True):
            p.grad = p - torch.stack(copies).mean(dim=0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for g in groups:
            for q, p in zip(g.parameters(), outer, strict=True):
                q.copy_(p)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("batches")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--total-steps", type=int, required=True, help="the schedule's length")
    p.add_argument("--min-lr-ratio", type=float, required=True)
    p.add_argument("--b1", type=float, required=True)
    p.add_argument("--b2", type=float, required=True)
    p.add_argument("--eps", type=float, required=True)
    p.add_argument("--weight-decay", type=float, required=True)
    p.add_argument("--clip", type=float, required=True)
    p.add_argument("--eos-id", type=int, default=None, help="packed documents; default: none")
    p.add_argument("--replicas", type=int, default=1, help="DiLoCo groups; default: 1 (plain)")
    p.add_argument("--sync-every", type=int, default=None, help="with --replicas: H")
    p.add_argument("--outer-lr", type=float, default=None, help="with --replicas")
    p.add_argument("--outer-momentum", type=float, default=None, help="with --replicas")
    args = p.parse_args()
    outer_flags = (args.sync_every, args.outer_lr, args.outer_momentum)
    if args.replicas > 1 and (None in outer_flags or args.sync_every < 1):
        p.error("--replicas > 1 needs --sync-every (>= 1), --outer-lr and --outer-momentum")
    if args.replicas == 1 and outer_flags != (None, None, None):
        p.error("the outer step's flags need --replicas > 1")

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one summation order, run to run
    torch.use_deterministic_algorithms(True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()  # the fixtures have no dropout; train mode as a loop would have it
    M = args.replicas
    groups = [model] + [copy.deepcopy(model) for _ in range(M - 1)]
    inner = [adamw(g, args) for g in groups]
    if M > 1:
        outer = [torch.nn.Parameter(q.detach().clone()) for q in model.parameters()]
        # torch refuses nesterov without momentum; jaxdist's momentum 0 is plain SGD
        mu = args.outer_momentum
        outer_opt = torch.optim.SGD(
            outer, lr=args.outer_lr, momentum=mu, nesterov=mu > 0, foreach=False
        )
    batches = np.load(args.batches).astype(np.int64)
    if batches.shape[1] % M:
        p.error(f"--replicas {M} does not divide the batch of {batches.shape[1]} rows")
    rows = batches.shape[1] // M
    out = {"loss": [], "grad_norm": [], "lr": []}
    for s, tokens in enumerate(batches):
        # group r on the r-th block of rows, as jaxdist splits the global batch
        per_group = [
            train_step(g, *opt, tokens[r * rows : (r + 1) * rows], args)
            for r, (g, opt) in enumerate(zip(groups, inner, strict=True))
        ]
        # out's keys are in train_step's order; each the mean over the groups
        for key, values in zip(out, zip(*per_group, strict=True), strict=True):
            out[key].append(float(np.mean(values)))
        if M > 1 and (s + 1) % args.sync_every == 0:
            outer_step(outer, outer_opt, groups)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

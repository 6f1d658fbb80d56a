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
"""

import argparse
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
    args = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one summation order, run to run
    torch.use_deterministic_algorithms(True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()  # the fixtures have no dropout; train mode as a loop would have it
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
    batches = np.load(args.batches).astype(np.int64)
    out = {"loss": [], "grad_norm": [], "lr": []}
    for tokens in batches:
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
        out["lr"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

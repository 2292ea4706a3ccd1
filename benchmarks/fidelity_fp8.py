"""FP8 training fidelity: a small MoE language model trained in bf16 and in FP8, seed for seed.

Issue 27, item 4. For each seed, one initialisation and one synthetic token
stream train the model twice: its experts (``GroupedMLP``, packed weights)
with ``fp8_recipe=None`` (bf16 GEMMs) and with ``fp8_recipe="blockwise"``
(their four GEMMs in FP8; attention, router and head stay bf16, as FP8
recipes leave them). fp32 master weights under bf16 autocast, AdamW, gradient
clipping; the experts' wgrads land in fp32 ``.grad`` straight from the GEMMs.

The model: token embedding, ``--layers`` pre-norm blocks (causal attention,
then a top-2 MoE of SwiGLU experts with a Switch load-balancing loss), an
untied head, token cross-entropy. The data: an order-2 Markov source over
``V`` tokens (fixed across seeds: each token has ``fanout`` successors, a
Zipf rank distribution, the ranks rotated by the previous token), sampled
on the device from the seed; ``loss_floor`` is its true per-token entropy.

Reported (JSON, PNG, markdown via ``fidelity_report.py``):

* every step's loss of every run; final loss = mean of the last 20 steps;
  per recipe the seed mean and spread (max − min); the gap FP8 − bf16 and
  whether it is within max(1.5 % of bf16's mean, 2× bf16's seed spread);
* ``wgrad_error``: fc1/fc2 wgrad errors of FP8 and bf16 against fp64 of the
  unquantized bf16 operands (per grouped GEMM and per ``GroupedMLP`` call),
  on operands captured from the first trained model (bf16, seed 0);
* ``main_grad``: after 4 micro-batches accumulated into fp32 ``main_grad``
  by an FP8 ``GroupedMLP``, the error against the fp64 sum of the dequantized
  operands' products, its ratio to one FP8 GEMM's error (≤ 2 wanted), and the
  bf16-exact share of ``main_grad`` (< 1 % wanted).

The JSON is rewritten after every run (``"complete": false`` until the end),
so a run cut short keeps what it finished; each run prints one line with its
seconds. Any fallback to the reference kernels on CUDA is printed, recorded
and makes the exit status 2.

Cost at the defaults (4 blocks, H = F = 1024, 8 experts, V = 4096, 16,384
tokens per step, 300 steps, 3 seeds × 2 recipes): 4.7 TFLOP per step, 8.5
PFLOP in all; estimated (not yet measured) 15–40 ms per step on an H200, so
1–3 minutes for the six runs plus the first FP8 step's Triton compiles and
the checks, after the CUTLASS build (1.5–3 minutes on a fresh machine, done
by ``bench_mlp``'s environment step as in every benchmark here). Each run's
line prints its ms per step; ``--steps``, ``--seeds``, ``--tokens``,
``--hidden``, ``--ffn``, ``--layers`` shrink or grow it.

Usage (H200): ``python benchmarks/fidelity_fp8.py --out benchmarks/results``;
smoke (CPU, reference kernels, < 60 s): ``python benchmarks/fidelity_fp8.py
--smoke --device cpu --out /tmp/fidelity``.

Legend: ``B`` sequences, ``S`` sequence length, ``T = B·S`` tokens, ``V``
vocabulary, ``H`` hidden, ``F`` expert ffn, ``E`` experts, ``k`` top-k,
``R = T·k`` routed rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import bench_mlp
import fidelity_report
import fidelity_wgrads
import results_files

from groupgrad.modules import GroupedMLP

LANGUAGE_SEED = 1234  # the Markov source: one "language" for every seed and recipe
RECIPES = {"bf16": None, "fp8": "blockwise"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data and training sizes (defaults: the H200 run)."""

    vocab: int = 4096
    hidden: int = 1024
    ffn: int = 1024
    experts: int = 8
    top_k: int = 2
    layers: int = 4
    heads: int = 8
    seq: int = 512
    tokens: int = 16384  # per step
    steps: int = 300
    seeds: int = 3
    lr: float = 2e-3
    warmup: int = 20
    aux_coef: float = 0.01
    fanout: int = 16
    final_window: int = 20
    eval_batches: int = 4  # held-out batches: eval loss, and the micro-batches of the checks

    @property
    def batch(self) -> int:
        return self.tokens // self.seq

    def flops_per_step(self) -> float:
        """Forward + backward matmul FLOPs of one step (3× the forward; causal attention halved)."""
        H, T = self.hidden, self.tokens
        per_layer = 8 * H * H + 2 * self.seq * H + self.top_k * 6 * H * self.ffn
        return 3 * T * (self.layers * per_layer + 2 * H * self.vocab)


SMOKE = Config(
    vocab=256, hidden=128, ffn=128, experts=4, layers=1, heads=2, seq=32, tokens=128, steps=3,
    seeds=1, lr=3e-3, warmup=0, fanout=4,
)  # fmt: skip


# ---------------------------------------------------------------- data


class MarkovSource:
    """Order-2 token source: ``next = successors[cur, (rank + shift[prev]) % fanout]``.

    ``rank`` follows a Zipf law over ``fanout`` ranks; the successor table and
    the shifts come from :data:`LANGUAGE_SEED`, the same for every seed.
    """

    def __init__(self, vocab: int, fanout: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(LANGUAGE_SEED)
        self.successors = torch.randint(0, vocab, (vocab, fanout), generator=g).to(device)
        self.shift = torch.randint(0, fanout, (vocab,), generator=g).to(device)
        zipf = 1.0 / torch.arange(1, fanout + 1, dtype=torch.float64)
        self.rank_probs = (zipf / zipf.sum()).to(device)
        self.entropy = float(-(self.rank_probs * self.rank_probs.log()).sum())
        self.vocab, self.fanout, self.device = vocab, fanout, device

    def sample(self, sequences: int, length: int, seed: int) -> Tensor:
        """``(sequences, length)`` int64 tokens from ``seed`` (on the device)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        cdf = self.rank_probs.float().cumsum(0)
        uniform = torch.rand(sequences, length, generator=g, device=self.device)
        ranks = torch.searchsorted(cdf, uniform).clamp_(max=self.fanout - 1)
        tokens = torch.empty(sequences, length, dtype=torch.int64, device=self.device)
        tokens[:, 0] = torch.randint(0, self.vocab, (sequences,), generator=g, device=self.device)
        prev = tokens[:, 0]
        for t in range(1, length):
            cur = tokens[:, t - 1]
            column = (ranks[:, t] + self.shift[prev]) % self.fanout
            tokens[:, t] = self.successors[cur, column]
            prev = cur
        return tokens


# ---------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm block: causal self-attention, then a top-k MoE of SwiGLU experts."""

    def __init__(self, cfg: Config, fp8_recipe: str | None) -> None:
        super().__init__()
        H = cfg.hidden
        self.heads, self.top_k = cfg.heads, cfg.top_k
        self.attn_norm, self.moe_norm = nn.RMSNorm(H), nn.RMSNorm(H)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)
        self.router = nn.Linear(H, cfg.experts, bias=False)
        self.experts = GroupedMLP(
            cfg.experts, H, cfg.ffn, single_grouped_weight=True, fp8_recipe=fp8_recipe
        )
        self.captures: list[fidelity_wgrads.Capture] | None = None  # set to record the experts' I/O

    def forward(self, x_BSH: Tensor) -> tuple[Tensor, Tensor]:
        B, S, H = x_BSH.shape
        qkv = self.qkv(self.attn_norm(x_BSH)).view(B, S, 3, self.heads, H // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BSH = x_BSH + self.proj(attn.transpose(1, 2).reshape(B, S, H))
        moe_TH, aux = self.moe(self.moe_norm(x_BSH).reshape(B * S, H))
        return x_BSH + moe_TH.view(B, S, H), aux

    def moe(self, t_TH: Tensor) -> tuple[Tensor, Tensor]:
        T, H = t_TH.shape
        E, k = self.experts.num_groups, self.top_k
        probs_TE = self.router(t_TH).float().softmax(dim=-1)
        top_p_Tk, top_i_Tk = probs_TE.topk(k, dim=-1)
        top_p_Tk = top_p_Tk / top_p_Tk.sum(dim=-1, keepdim=True)
        expert_R, slots_R = torch.sort(top_i_Tk.reshape(-1), stable=True)
        splits_E = torch.zeros(E, dtype=torch.int64, device=t_TH.device)
        splits_E.index_add_(0, expert_R, torch.ones_like(expert_R))  # no host sync
        token_R = slots_R // k
        x_RH = t_TH[token_R].to(torch.bfloat16)
        probs_R = top_p_Tk.reshape(-1)[slots_R]
        y_RH = self.experts(x_RH, splits_E, probs_R)
        if self.captures is not None:
            self._capture(x_RH, splits_E, probs_R, y_RH)
        out_TH = torch.zeros(T, H, dtype=torch.float32, device=t_TH.device)
        out_TH = out_TH.index_add(0, token_R, y_RH.float())
        aux = E * (splits_E.float() / (T * k) * probs_TE.mean(dim=0)).sum()  # Switch
        return out_TH, aux

    def _capture(self, x_RH: Tensor, splits_E: Tensor, probs_R: Tensor, y_RH: Tensor) -> None:
        inputs = (x_RH.detach().clone(), splits_E.clone(), probs_R.detach().clone())

        def keep(dy_RH: Tensor) -> None:
            assert self.captures is not None
            self.captures.append((*inputs, dy_RH.detach().to(torch.bfloat16).clone()))

        y_RH.register_hook(keep)


class MoELM(nn.Module):
    """Embedding, ``layers`` :class:`Block` s, final norm, untied head."""

    def __init__(self, cfg: Config, fp8_recipe: str | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, fp8_recipe) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens_BS: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(tokens_BS)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        return self.head(self.norm(x)), aux / len(self.blocks)


def lm_loss(model: MoELM, batch_BS: Tensor) -> tuple[Tensor, Tensor]:
    """Token cross-entropy (fp32) and the load-balancing loss, under bf16 autocast."""
    with torch.autocast(batch_BS.device.type, dtype=torch.bfloat16):
        logits, aux = model(batch_BS[:, :-1])
    ce = F.cross_entropy(logits.float().flatten(0, 1), batch_BS[:, 1:].flatten())
    return ce, aux


# ---------------------------------------------------------------- training


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    cfg: Config, recipe: str, seed: int, data: Tensor, init: dict[str, Tensor], label: str
) -> tuple[dict, MoELM]:
    """Train one model; the run's record (losses, final loss, seconds) and the model."""
    device = data.device
    with device:
        model = MoELM(cfg, RECIPES[recipe])
    model.load_state_dict(init)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
        fused=device.type == "cuda",
    )  # fmt: skip

    def lr_factor(step: int) -> float:
        warm = min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else 1.0
        return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / cfg.steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses = torch.empty(cfg.steps, device=device)
    _sync(device)
    start = time.perf_counter()
    marks: dict[int, float] = {}
    for step in range(cfg.steps):
        ce, aux = lm_loss(model, data[step * cfg.batch : (step + 1) * cfg.batch])
        (ce + cfg.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = ce.detach()
        if step + 1 in (1, 10) or (step + 1) % 100 == 0 or step + 1 == cfg.steps:
            _sync(device)
            marks[step + 1] = time.perf_counter() - start
            print(
                f"  {label} step {step + 1}/{cfg.steps}: loss {losses[step].item():.4f}, "
                f"{marks[step + 1]:.1f} s",
                flush=True,
            )
    seconds = time.perf_counter() - start
    curve = losses.tolist()
    window = curve[-min(cfg.final_window, cfg.steps) :]
    timed = cfg.steps - 10 if cfg.steps > 10 else 0
    record = {
        "recipe": recipe,
        "seed": seed,
        "losses": curve,
        "final_loss": sum(window) / len(window),
        "seconds": seconds,
        "first_step_seconds": marks[1],
        "ms_per_step_after_10": 1e3 * (seconds - marks[10]) / timed if timed else None,
    }
    return record, model


@torch.no_grad()
def eval_loss(model: MoELM, batches: Tensor, batch: int) -> float:
    return float(
        sum(lm_loss(model, batches[i : i + batch])[0] for i in range(0, len(batches), batch))
        / (len(batches) // batch)
    )


def capture_experts(model: MoELM, batches: Tensor, batch: int) -> list[fidelity_wgrads.Capture]:
    """The middle block's experts' ``(x, splits, probs, dy)`` of one forward + backward per batch."""
    block = model.blocks[len(model.blocks) // 2]
    assert isinstance(block, Block)
    block.captures = []
    for i in range(0, len(batches), batch):
        lm_loss(model, batches[i : i + batch])[0].backward()
    captures, block.captures = block.captures, None
    model.zero_grad(set_to_none=True)
    return captures


# ---------------------------------------------------------------- the run


def run(cfg: Config, device: torch.device, out: Path | None, stem: str, result: dict) -> dict:
    """Every seed × recipe, then the wgrad checks; ``result`` filled in and written as it goes."""
    source = MarkovSource(cfg.vocab, cfg.fanout, device)
    held_out = source.sample(cfg.eval_batches * cfg.batch, cfg.seq + 1, seed=10**6)
    result.update(
        config=dataclasses.asdict(cfg),
        flops_per_step=cfg.flops_per_step(),
        loss_floor=source.entropy,
        loss_start=math.log(cfg.vocab),
        runs=[],
        complete=False,
    )
    print(
        f"model: {cfg.layers} blocks, H {cfg.hidden}, {cfg.experts} experts (F {cfg.ffn}, "
        f"top-{cfg.top_k}), V {cfg.vocab}; {cfg.tokens} tokens/step "
        f"({cfg.flops_per_step() / 1e12:.2f} TFLOP/step), {cfg.steps} steps; loss from "
        f"ln V = {math.log(cfg.vocab):.3f}, floor {source.entropy:.3f}",
        flush=True,
    )
    for seed in range(cfg.seeds):
        data = source.sample(cfg.steps * cfg.batch, cfg.seq + 1, seed=seed)
        torch.manual_seed(seed)
        with device:
            untrained = MoELM(cfg, None)
        init = {k: v.detach().clone() for k, v in untrained.state_dict().items()}
        eval_init = eval_loss(untrained, held_out, cfg.batch)
        del untrained
        for recipe in RECIPES:
            label = f"{recipe} seed {seed}"
            record, model = train(cfg, recipe, seed, data, init, label)
            record["eval_loss"] = eval_loss(model, held_out, cfg.batch)
            record["eval_loss_init"] = eval_init
            result["runs"].append(record)
            print(
                f"run {label}: final loss {record['final_loss']:.4f}, held-out "
                f"{eval_init:.4f} -> {record['eval_loss']:.4f}, {record['seconds']:.1f} s "
                f"(first step {record['first_step_seconds']:.1f} s, then "
                f"{record['ms_per_step_after_10'] or float('nan'):.1f} ms/step)",
                flush=True,
            )
            if "wgrad_error" not in result:
                _checks(model, held_out, cfg, result)
            del model
            _write_partial(out, stem, result)
    result["summary"] = fidelity_report.summarize(result)
    result["complete"] = True
    return result


def _checks(model: MoELM, held_out: Tensor, cfg: Config, result: dict) -> None:
    """Items 3 and 4 of the issue on the first trained model's middle block."""
    start = time.perf_counter()
    captures = capture_experts(model, held_out, cfg.batch)
    master = model.blocks[len(model.blocks) // 2].experts
    assert isinstance(master, GroupedMLP)
    result["wgrad_error"] = fidelity_wgrads.wgrad_errors(master, captures[0])
    result["main_grad"] = fidelity_wgrads.main_grad_check(master, captures)
    print(fidelity_report.checks_lines(result), flush=True)
    print(f"checks: {time.perf_counter() - start:.1f} s", flush=True)


def _write_partial(out: Path | None, stem: str, result: dict) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = fidelity_report.summarize(result)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))


def parse_config(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write JSON + PNG into this folder")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 steps, 1 seed")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", type=str, default=default_device)
    for name in ("steps", "seeds", "tokens", "hidden", "ffn", "layers", "vocab", "seq"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else Config()
    given = {
        k: v
        for k, v in vars(args).items()
        if k in {f.name for f in dataclasses.fields(Config)} and v is not None
    }
    cfg = dataclasses.replace(cfg, **given)
    if cfg.tokens % cfg.seq:
        raise SystemExit(f"--tokens {cfg.tokens} is not a multiple of --seq {cfg.seq}")
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_config(argv)
    device = torch.device(args.device)
    recorder = bench_mlp._Recorder()
    logging.getLogger("groupgrad").addHandler(recorder)
    try:
        result = bench_mlp._environment(device, recorder)
        stem = results_files.gpu_stem("fidelity_fp8_", result["gpu"])
        stem += "_smoke" if args.smoke else ""
        run(cfg, device, args.out, stem, result)
        result["fallbacks"] = recorder.messages
        print(fidelity_report.markdown(result))
        if args.out is not None:
            results_files.write_results(args.out, stem, result, fidelity_report.plot)
    finally:
        logging.getLogger("groupgrad").removeHandler(recorder)
    if recorder.messages and device.type == "cuda":
        print("!! some work ran on a fallback path (reference kernels), not the GPU's kernels")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

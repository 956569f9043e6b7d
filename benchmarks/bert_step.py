"""One BERT masked-LM training step in Python PyTorch eager, timed exactly like bert_step.cpp.

The model is train's BertModel with the MLM head (libtrain/include/train/models/bert.h) written
out in plain torch.nn, not taken from transformers (a GPU machine may not have it): word +
position + token-type embeddings, LayerNorm (eps 1e-12) and dropout; post-LN encoder layers with
F.scaled_dot_product_attention (or the written-out softmax with --attention plain) and exact GELU;
the MLM transform (dense, GELU, LayerNorm) and a decoder tied to the word embeddings plus a bias;
normal(0, 0.02) init. Parameter names are Hugging Face's, as in the C++ model, so weights move
between the two by name. AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-6, weight decay 0.01 on
tensors of 2+ dimensions only, as train's optimizer groups them), fused or foreach like the C++
side reports (--optim-impl), cross-entropy over the masked positions, optional bf16 autocast, a
fixed synthetic batch already on the device built from the same seed as the C++ one.
Prints one JSON line.

    bert_step.py --check FILE [--device cpu]
reads a file from `bench_bert_step --save-check FILE`, loads its weights, and compares the
eval-mode logits, the training losses and the weights after the C++ training steps with this
model's; prints one JSON line and exits 1 when they differ by more than the tolerances.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from step_timing import median, profile_steps, run_or_serve, time_windows

# Sizes of train's presets (BertOptions::preset): layers, hidden, heads; intermediate 4 x hidden,
# 512 positions, vocab 30522, 2 token types.
PRESETS = {"bert-base": (12, 768, 12), "bert-small": (4, 512, 8), "bert-mini": (4, 256, 4),
           "bert-tiny": (2, 128, 2), "minilm-l6": (6, 384, 12)}
VOCAB, POSITIONS, TYPES, PAD_ID, MASK_ID = 30522, 512, 2, 0, 103
MASK_FRACTION, LR = 0.15, 1e-4
# --check tolerances (fp32 on both sides; the differences are rounding in different kernels).
LOGITS_TOL, LOSS_TOL, WEIGHTS_TOL = 1e-4, 1e-5, 1e-6


class Container(nn.Module):
    """A bare module, so that names nest like Hugging Face's (`attention.self.query`)."""


def linear(n_in, n_out, std):
    m = nn.Linear(n_in, n_out)
    nn.init.normal_(m.weight, 0.0, std)
    nn.init.zeros_(m.bias)
    return m


def additive_mask(keep, dtype):
    """0 where a key is attended, the dtype's lowest finite value where padded (as the C++ model)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads, intermediate, dropout, attention, qkv="separate"):
        super().__init__()
        self.heads, self.head_dim, self.attention_dropout = heads, hidden // heads, dropout
        self.attention_impl, self.qkv = attention, qkv
        self.attention = Container()
        self.attention.add_module("self", Container())
        attn_self = getattr(self.attention, "self")
        attn_self.query = linear(hidden, hidden, 0.02)
        attn_self.key = linear(hidden, hidden, 0.02)
        attn_self.value = linear(hidden, hidden, 0.02)
        self.attention.output = Container()
        self.attention.output.dense = linear(hidden, hidden, 0.02)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = Container()
        self.intermediate.dense = linear(hidden, intermediate, 0.02)
        self.output = Container()
        self.output.dense = linear(intermediate, hidden, 0.02)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, keep, masks):
        b, t, _ = x.shape
        attn_self = getattr(self.attention, "self")

        def split(y):
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        if self.qkv == "fused":  # one projection, as train's C++ layer computes it
            qkv = F.linear(x, torch.cat([attn_self.query.weight, attn_self.key.weight, attn_self.value.weight]),
                           torch.cat([attn_self.query.bias, attn_self.key.bias, attn_self.value.bias]))
            q, k, v = qkv.view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:  # three, as Hugging Face's BertSelfAttention computes them
            q, k, v = split(attn_self.query(x)), split(attn_self.key(x)), split(attn_self.value(x))
        p = self.attention_dropout if self.training else 0.0
        if keep is not None and not masks:  # made by the first layer, in the attention's dtype
            masks.append(additive_mask(keep, q.dtype))
        m = masks[0] if masks else None
        if self.attention_impl == "fused":
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores if m is None else scores + m, dim=-1)
            if p > 0:
                probs = F.dropout(probs, p, training=True)
            context = probs @ v
        context = context.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        h = self.attention.output.LayerNorm(self.dropout(self.attention.output.dense(context)) + x)
        ffn = self.output.dense(F.gelu(self.intermediate.dense(h)))
        return self.output.LayerNorm(self.dropout(ffn) + h)


class BertForMaskedLM(nn.Module):
    def __init__(self, preset, dropout=0.1, attention="fused", qkv="separate"):
        super().__init__()
        layers, hidden, heads = PRESETS[preset]
        self.embeddings = Container()
        self.embeddings.word_embeddings = nn.Embedding(VOCAB, hidden, padding_idx=PAD_ID)
        self.embeddings.position_embeddings = nn.Embedding(POSITIONS, hidden)
        self.embeddings.token_type_embeddings = nn.Embedding(TYPES, hidden)
        self.embeddings.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.embeddings.dropout = nn.Dropout(dropout)
        with torch.no_grad():
            for e in (self.embeddings.word_embeddings, self.embeddings.position_embeddings,
                      self.embeddings.token_type_embeddings):
                e.weight.normal_(0.0, 0.02)
            self.embeddings.word_embeddings.weight[PAD_ID].zero_()
        self.encoder = Container()
        self.encoder.layer = nn.ModuleList(
            BertLayer(hidden, heads, 4 * hidden, dropout, attention, qkv) for _ in range(layers))
        self.cls = Container()
        self.cls.predictions = Container()
        self.cls.predictions.bias = nn.Parameter(torch.zeros(VOCAB))
        self.cls.predictions.transform = Container()
        self.cls.predictions.transform.dense = linear(hidden, hidden, 0.02)
        self.cls.predictions.transform.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.sizes = {"layers": layers, "hidden": hidden, "heads": heads, "intermediate": 4 * hidden,
                      "vocab": VOCAB}

    def forward(self, ids, has_target=None):
        """Logits [B, T, vocab]; with has_target ([B, T] bool), logits [N, vocab] at those positions only."""
        emb = self.embeddings
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device).unsqueeze(0)
        x = emb.word_embeddings(ids) + emb.position_embeddings(positions)
        x = x + emb.token_type_embeddings.weight[0].view(1, 1, -1)
        x = emb.dropout(emb.LayerNorm(x))
        keep = (ids != PAD_ID).view(ids.shape[0], 1, 1, t)
        if bool(keep.all()):  # no padding: no mask, so that SDPA may take the flash kernel (as the C++ model)
            keep = None
        masks = []
        for layer in self.encoder.layer:
            x = layer(x, keep, masks)
        if has_target is not None:  # the head only where there is a target, as train's trainer does
            x = x.reshape(-1, x.shape[-1]).index_select(0, has_target.reshape(-1).nonzero().squeeze(1))
        tr = self.cls.predictions.transform
        h = tr.LayerNorm(F.gelu(tr.dense(x)))
        return F.linear(h, emb.word_embeddings.weight, self.cls.predictions.bias)


def make_optimizer(model, impl):
    decay = [q for q in model.parameters() if q.dim() > 1]
    no_decay = [q for q in model.parameters() if q.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.999), eps=1e-6,
                             fused=impl == "fused", foreach=impl == "foreach")


def make_batch(batch, seq, device):
    """The fixed MLM batch of bert_step.cpp: same seed, same draws on the CPU, so the same tensors."""
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, seq))
    chosen = torch.rand(batch, seq) < MASK_FRACTION
    return ids.masked_fill(chosen, MASK_ID).to(device), ids.masked_fill(~chosen, -100).to(device)


def make_step(model, optimizer, inputs, labels, device, bf16):
    def step():
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            has_target = labels != -100
            logits = model(inputs, has_target)
            loss = F.cross_entropy(logits.view(-1, VOCAB).float(), labels.masked_select(has_target))
        loss.backward()
        optimizer.step()
        return loss
    return step


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    """(tensors, metadata) of a safetensors file; written here so that no package is needed."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        flat = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors, metadata


def check(path, device):
    """Compares this model with the C++ one on the check file; returns the report and whether it passed."""
    tensors, meta = read_safetensors(path)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = BertForMaskedLM(meta["preset"], dropout=0.0, attention=meta["attention"]).to(device)
    initial = {k[len("initial."):]: v for k, v in tensors.items() if k.startswith("initial.")}
    ours = set(model.state_dict())
    if ours != set(initial):
        raise SystemExit(f"bert_step.py --check: parameter names differ; only in C++: {sorted(set(initial) - ours)}, "
                         f"only in Python: {sorted(ours - set(initial))}")
    model.load_state_dict(initial, strict=True)
    inputs, labels = tensors["check.input"].to(device), tensors["check.labels"].to(device)
    ref_inputs, ref_labels = make_batch(inputs.shape[0], inputs.shape[1], device)
    same_batch = torch.equal(inputs, ref_inputs) and torch.equal(labels, ref_labels)
    model.eval()
    with torch.no_grad():
        logits_diff = (model(inputs).cpu() - tensors["check.eval_logits"]).abs().max().item()
    model.train()
    impl = meta["optimizer"].split()[-1]  # "adamw fused" -> fused
    step = make_step(model, make_optimizer(model, impl), inputs, labels, device, bf16=False)
    losses = torch.stack([step().detach().cpu() for _ in range(int(meta["check_steps"]))])
    loss_diff = (losses - tensors["check.losses"]).abs().max().item() if losses.numel() else 0.0
    after = model.state_dict()
    weights_diff, worst = 0.0, ""
    for k, v in tensors.items():
        if k.startswith("after."):
            d = (after[k[len("after."):]].cpu() - v).abs().max().item()
            if d > weights_diff:
                weights_diff, worst = d, k[len("after."):]
    ok = same_batch and logits_diff <= LOGITS_TOL and loss_diff <= LOSS_TOL and weights_diff <= WEIGHTS_TOL
    report = {"impl": "python", "check": "pass" if ok else "FAIL", "preset": meta["preset"],
              "device": str(device), "attention": meta["attention"], "optimizer": meta["optimizer"],
              "same_batch": same_batch, "params": len(initial),
              "max_abs_logits_diff": logits_diff, "logits_tol": LOGITS_TOL,
              "logits_max_abs": tensors["check.eval_logits"].abs().max().item(),
              "losses_cpp": tensors["check.losses"].tolist(), "losses_python": losses.tolist(),
              "max_abs_loss_diff": loss_diff, "loss_tol": LOSS_TOL,
              "max_abs_weights_diff_after_steps": weights_diff, "worst_weight": worst, "weights_tol": WEIGHTS_TOL,
              "cpp_torch": meta.get("torch"), "python_torch": torch.__version__}
    return report, ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="bert-base", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--attention", default="fused", choices=["fused", "plain"],
                   help="fused = F.scaled_dot_product_attention; compare_bert.py passes what the C++ side ran")
    p.add_argument("--qkv", default="separate", choices=["separate", "fused"],
                   help="separate: query, key and value projected by three Linear layers, as Hugging Face writes "
                        "BERT (what a Python user runs); fused: one projection through their concatenated weights, "
                        "as train's C++ layer computes it (the same function and parameters)")
    p.add_argument("--optim-impl", default="fused", choices=["fused", "foreach"],
                   help="torch.optim.AdamW(fused=True) or (foreach=True); compare_bert.py passes the C++ side's")
    p.add_argument("--threads", type=int, default=0, help="intra-op CPU threads; 0 = PyTorch's default")
    p.add_argument("--check", default="", help="a file from bench_bert_step --save-check: compare instead of timing")
    p.add_argument("--profile", default="",
                   help="FILE: instead of timing, profile --profile-steps steps after --warmup and write where the "
                        "time goes (kernels by kind and by name, operators) to FILE; prints the summary line")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--serve", type=int, default=0, choices=[0, 1],
                   help="1: set up once, then time and print a line for each 'run' on standard input")
    a = p.parse_args()

    device = torch.device(a.device)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if a.check:
        report, ok = check(a.check, device)
        print(json.dumps(report), flush=True)
        sys.exit(0 if ok else 1)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = BertForMaskedLM(a.preset, dropout=0.1, attention=a.attention, qkv=a.qkv).to(device)
    model.train()
    optimizer = make_optimizer(model, a.optim_impl)
    inputs, labels = make_batch(a.batch, a.seq, device)
    step = make_step(model, optimizer, inputs, labels, device, a.precision == "bf16")

    def run():
        rates = time_windows(step, device, a.warmup, a.steps, a.window, a.batch)
        print(json.dumps({"impl": "python", "pid": os.getpid(), "preset": a.preset, **model.sizes,
                          "params": sum(q.numel() for q in model.parameters()), "batch": a.batch, "seq": a.seq,
                          "precision": a.precision, "attention": a.attention, "qkv": a.qkv, "optimizer": f"adamw {a.optim_impl}",
                          "threads": torch.get_num_threads(), "targets": int((labels != -100).sum()),
                          "input_sum": int(inputs.sum()), "windows": len(rates), "seq_per_s": median(rates),
                          "min": rates[0], "max": rates[-1]}), flush=True)

    if a.profile:
        print(json.dumps(profile_steps(step, device, a.warmup, a.profile_steps, a.profile, a.batch, f"bert_step.py {a.preset} batch {a.batch} seq {a.seq} {a.precision}")),
              flush=True)
        return
    run_or_serve(a.serve, run)


if __name__ == "__main__":
    main()

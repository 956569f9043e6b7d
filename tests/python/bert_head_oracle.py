#!/usr/bin/env python3
"""Hugging Face head-model checkpoints and their logits, for loading into train's BERT, offline.

    bert_head_oracle.py OUT_DIR

A randomly initialised tiny BertForMaskedLM and BertForSequenceClassification (vocab 100,
hidden 128, 2 layers, 2 heads, intermediate 512, 32 positions, 3 labels: train's bert-tiny with
the C++ test's sizes) saved with save_pretrained, which writes the encoder under "bert." and the
heads ("cls.", "classifier.") at the top level, dropping the tied decoder. Writes into OUT_DIR:
  mlm/model.safetensors, classifier/model.safetensors   as save_pretrained writes them
  mlm_tf_names/model.safetensors, mlm_tf_names/config.json
                          the masked-LM file with TensorFlow's LayerNorm names, as in checkpoints
                          ported from Google's BERT (bert-base-uncased): "LayerNorm.gamma" for
                          "LayerNorm.weight", "LayerNorm.beta" for "LayerNorm.bias"; checked here
                          to load in transformers (which renames them) with the same logits
  reference.safetensors   input_ids [2, 12] (int64, the second row padded with id 0) and
                          mlm_logits [2, 12, 100], classifier_logits [2, 3] (float32) in eval mode
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification
except ImportError as e:
    sys.exit("bert_head_oracle.py: %s; run scripts/setup (pip install -r scripts/requirements-test.txt)" % e)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: bert_head_oracle.py OUT_DIR")
    out = sys.argv[1]
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512, max_position_embeddings=32, num_labels=3,
                        attn_implementation="eager")
    mlm = BertForMaskedLM(config).eval()
    classifier = BertForSequenceClassification(config).eval()
    # Non-zero biases and LayerNorm parameters, so that a tensor left at its init shows up.
    with torch.no_grad():
        for model in (mlm, classifier):
            for name, p in model.named_parameters():
                if name.endswith("bias") or "LayerNorm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    mlm.save_pretrained(os.path.join(out, "mlm"), safe_serialization=True)
    classifier.save_pretrained(os.path.join(out, "classifier"), safe_serialization=True)
    ids = torch.randint(5, 100, (2, 12))
    ids[0, 0], ids[1, 0] = 2, 2
    ids[1, 8:] = 0
    mask = (ids != 0).long()
    tf_dir = os.path.join(out, "mlm_tf_names")
    os.makedirs(tf_dir, exist_ok=True)
    tf_names = {}
    for key, value in load_file(os.path.join(out, "mlm", "model.safetensors")).items():
        for new, old in (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias")):
            if key.endswith(old):
                key = key[: -len(old)] + new
        tf_names[key] = value
    save_file(tf_names, os.path.join(tf_dir, "model.safetensors"), metadata={"format": "pt"})
    mlm.config.to_json_file(os.path.join(tf_dir, "config.json"))
    with torch.no_grad():
        mlm_logits = mlm(input_ids=ids, attention_mask=mask).logits.contiguous()
        # The renamed file is what transformers itself accepts as the same model; if a version
        # stopped renaming, the C++ test would be checking a layout nobody loads.
        tf_model = BertForMaskedLM.from_pretrained(tf_dir, attn_implementation="eager").eval()
        tf_error = (tf_model(input_ids=ids, attention_mask=mask).logits - mlm_logits).abs().max().item()
        if tf_error > 1e-6:
            sys.exit("bert_head_oracle.py: transformers loads the gamma/beta file with logits %g off" % tf_error)
        save_file({"input_ids": ids,
                   "mlm_logits": mlm_logits,
                   "classifier_logits": classifier(input_ids=ids, attention_mask=mask).logits.contiguous()},
                  os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()

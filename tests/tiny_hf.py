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


def save_tiny(kind: str, path) -> str:
    """Save a tiny random model of ``kind`` ("bert": 2 layers, 4 heads of 8; "llama": 2 layers,
    4 query heads sharing 2 key/value heads of 16, RoPE base 500; "llama_lm": the same with an LM
    head) with its tokenizer to ``path``."""
    import transformers

    vocab = len(WORDS) + 4
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=48, max_position_embeddings=64, initializer_range=0.2)
        model = transformers.BertModel(config)
    elif kind == "llama_lm":   # the same Llama with its LM head: a causal LM that generates
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                          rope_theta=500.0, initializer_range=0.2, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                          rope_theta=500.0, initializer_range=0.2)
        model = transformers.LlamaModel(config)
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(path)
    _tokenizer(kind == "bert").save_pretrained(path)
    return str(path)

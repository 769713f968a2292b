"""Tiny model shapes shared by the tests (``ModelConfig`` fields). All are Llama-style with grouped
query attention (4 query heads over 2 K/V groups), so GQA layouts are always exercised."""

# 8 layers: pp=4 x vpp=2 still gives each chunk a layer
TINY_GQA_8L = dict(
    num_layers=8,
    hidden_size=64,
    ffn_hidden_size=160,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=128,
    seq_length=32,
    rotary_base=10000.0,
)

# 4 layers: pp=2 x vpp=2 by hand; the pure-torch Llama checks it layer by layer
TINY_GQA_4L = dict(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=160,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    seq_length=32,
)

# 2 layers over long packs: context parallelism splits documents of up to 1024 tokens
TINY_GQA_2L_LONG = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    seq_length=1024,
    rotary_base=10000.0,
)

# 2 narrow layers (head dim 8): what the Megatron-Bridge providers build
NARROW_GQA_2L = dict(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    seq_length=32,
    rotary_base=10000.0,
)

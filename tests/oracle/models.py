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


# Megatron-LM's parsed flags for a 2-layer model on context parallelism 2 (zeppelin engine, no SlimPipe):
# what the launcher's start-up checks read from an argparse namespace
TINY_CP_MEGATRON_ARGS = dict(
    cp_engine="zeppelin",
    cp_remap=False,
    context_parallel_size=2,
    use_slimpipe=False,
    micro_batch_size=1,
    pipeline_model_parallel_size=1,
    tensor_model_parallel_size=1,
    sequence_parallel=False,
    position_embedding_type="rope",
    attention_dropout=0.0,
    reset_position_ids=True,
    reset_attention_mask=True,
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=160,
    num_attention_heads=4,
    num_query_groups=2,
    group_query_attention=True,
    seq_length=64,
    padded_vocab_size=128,
    data_parallel_size=1,
    global_batch_size=2,
    slimpipe_hardware="cpu",
    slimpipe_num_slices=1,
    slimpipe_slice_policy="uniform",
    rotary_base=10000.0,
)

import argparse
import os


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)", allow_abbrev=False)
    g = parser.add_argument_group("network size")
    for name in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--seq-length", "--max-position-embeddings", "--vocab-size",
                 "--micro-batch-size", "--global-batch-size", "--train-iters", "--seed",
                 "--num-layers-per-virtual-pipeline-stage", "--num-experts"):
        g.add_argument(name, type=int, default=None)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        g.add_argument(name, type=int, default=1)  # Megatron-LM's defaults
    for name in ("--group-query-attention", "--swiglu", "--disable-bias-linear", "--sequence-parallel",
                 "--overlap-p2p-comm", "--bf16", "--untie-embeddings-and-output-weights", "--reset-position-ids",
                 "--reset-attention-mask", "--calculate-per-token-loss"):
        g.add_argument(name, action="store_true")
    g.add_argument("--normalization", default="LayerNorm")
    g.add_argument("--position-embedding-type", default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000)
    g.add_argument("--lr", type=float, default=None)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args, defaults={}):
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.tensor_model_parallel_size = args.tensor_model_parallel_size or 1
    args.pipeline_model_parallel_size = args.pipeline_model_parallel_size or 1
    args.context_parallel_size = args.context_parallel_size or 1
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = args.world_size // model_parallel
    args.virtual_pipeline_model_parallel_size = (
        args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
        if args.num_layers_per_virtual_pipeline_stage else None)
    args.padded_vocab_size = args.vocab_size
    args.decoder_seq_length = None
    return args

"""Stand-in for Megatron-LM's pretrain_gpt.py (same shape: spec builder imported by name at import
time, model_provider, forward_step, loss_func returning (loss, num_tokens, report), pretrain())."""
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from megatron.training import get_args, pretrain


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        normalization=args.normalization, gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, bias_activation_fusion=False,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        persist_layer_norm=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                     post_process=post_process, share_embeddings_and_output_weights=False,
                     position_embedding_type=args.position_embedding_type, rotary_base=int(args.rotary_base),
                     vp_stage=vp_stage)
    # CPU only (not in the real script): megatron's rotary table lives on CUDA
    from megatron_slim.megatron.rotary import make_cpu_rotary_embedding

    model.rotary_pos_emb = make_cpu_rotary_embedding(kv_channels=args.hidden_size // args.num_attention_heads,
                                                     rotary_percent=1.0, rotary_base=int(args.rotary_base),
                                                     use_cpu_initialization=True)
    return model


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1))
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider():
    args = get_args()

    def batches(iteration):
        g = torch.Generator().manual_seed(1000)  # the same batch every iteration: the loss must fall
        m = args.global_batch_size // args.micro_batch_size // args.data_parallel_size
        for _ in range(m):
            tokens = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
            s = args.seq_length
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(args.micro_batch_size, s),
                   "position_ids": torch.arange(s).expand(args.micro_batch_size, s),
                   "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)}
    return batches


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)

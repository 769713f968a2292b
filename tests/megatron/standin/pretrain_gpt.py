"""Stand-in for Megatron-LM's pretrain_gpt.py (same shape: spec builder and get_batch_on_this_cp_rank
imported by name at import time, model_provider, get_batch -> get_batch_on_this_cp_rank, forward_step,
loss_func returning (loss, num_tokens, report), pretrain())."""
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron.training import get_args, pretrain


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        normalization=args.normalization, gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, bias_activation_fusion=False,
        context_parallel_size=args.context_parallel_size, calculate_per_token_loss=args.calculate_per_token_loss,
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


def get_batch(data_iterator):
    batch = next(data_iterator)  # the real script: get_batch_on_this_tp_rank(data_iterator) (TP=1 here)
    batch = get_batch_on_this_cp_rank(batch)
    return batch.values()


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def document_starts(s):
    """Where documents start in every row (the real GPTDataset finds them after eod tokens)."""
    return [0, 5, s // 2 - 3, s // 2 + 7]


def masks_and_positions(b, s, args):
    """Megatron's get_ltor_masks_and_position_ids for rows whose documents start at document_starts."""
    position_ids = torch.arange(s).expand(b, s).clone()
    mask = torch.ones(b, 1, s, s).tril()
    starts = document_starts(s)
    for start, end in zip(starts[1:], starts[2:] + [s]):
        if args.reset_attention_mask:
            mask[:, 0, start:, :start] = 0
        if args.reset_position_ids:
            position_ids[:, start:end] = torch.arange(end - start)
    return mask < 0.5, position_ids


def train_valid_test_datasets_provider():
    args = get_args()

    def batches(iteration):
        g = torch.Generator().manual_seed(1000)  # the same batch every iteration: the loss must fall
        m = args.global_batch_size // args.micro_batch_size // args.data_parallel_size
        for _ in range(m):
            tokens = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
            b, s = args.micro_batch_size, args.seq_length
            attention_mask, position_ids = masks_and_positions(b, s, args)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(b, s),
                   "attention_mask": attention_mask, "position_ids": position_ids}
    return batches


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)

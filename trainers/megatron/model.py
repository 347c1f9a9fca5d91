"""Build a megatron-core GPTModel (local layer spec) from an HF Qwen2/Llama config, set up
the process groups, and compute vocab-parallel token log-probs and entropy from its logits."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from infra.ports import free_port
from trainers.megatron.weight_mapping import ModelShape, padded_vocab_size

Tensor = torch.Tensor


def process_group_backend(cuda_available: bool) -> str:
    """nccl whenever the ranks hold CUDA tensors (gloo cannot all-reduce them: megatron's DDP
    fails at its first step), gloo on CPU; for every world size, one included."""
    return "nccl" if cuda_available else "gloo"


def init_distributed(tp_size: int = 1, pp_size: int = 1, seed: int = 1234) -> None:
    """Join (or create, single-process) the default process group and megatron's TP/PP/DP groups.

    Uses the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when present,
    else a world of one over an in-memory store. Backend: nccl on GPU, gloo on CPU.
    """
    from megatron.core import parallel_state as ps

    cuda = torch.cuda.is_available()
    backend = process_group_backend(cuda)
    if not torch.distributed.is_initialized() and cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        # a world of one needs no rendezvous: an in-memory store, no TCP port to race for
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    world = torch.distributed.get_world_size()
    if world % (tp_size * pp_size):
        raise ValueError(f"world size {world} is not a multiple of tensor_model_parallel_size"
                         f" * pipeline_model_parallel_size = {tp_size * pp_size}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                     pipeline_model_parallel_size=pp_size)
    else:
        have = (ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size())
        if have != (tp_size, pp_size):
            raise ValueError(f"this process already runs megatron with (tensor, pipeline) "
                             f"parallel sizes {have}, not {(tp_size, pp_size)}")
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)


def transformer_config(shape: ModelShape, tp_size: int = 1, pp_size: int = 1,
                       dtype: torch.dtype = torch.float32):
    """The megatron ``TransformerConfig`` equal to the HF architecture (no dropout)."""
    from megatron.core.transformer import TransformerConfig

    cuda = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype, use_cpu_initialization=not cuda,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )


def build_gpt_model(shape: ModelShape, tp_size: int = 1, pp_size: int = 1,
                    dtype: torch.dtype = torch.float32):
    """A GPTModel with the local layer spec for this process's PP stage (process groups must
    be initialised). Its vocabulary is padded to a multiple of ``tp_size``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(shape, tp_size, pp_size, dtype)
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(shape.vocab_size, tp_size),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta)
        if float(shape.rope_theta).is_integer() else shape.rope_theta,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """megatron's explicit boolean attention mask [1, 1, s, s]: True above the diagonal
    (masked). Right-padded batches need nothing more: real tokens never see later pads."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device),
                      diagonal=1)[None, None]


def forward_logits(model, input_ids: Tensor) -> Tensor:
    """Vocab-parallel logits [B, S, V_pad / tp] of a right-padded batch ``input_ids`` [B, S]."""
    b, s = input_ids.shape
    pos = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    return model(input_ids, pos, causal_mask(s, input_ids.device))


def _vocab_range(local_vocab: int) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    start = ps.get_tensor_model_parallel_rank() * local_vocab
    return start, start + local_vocab


def mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Set the logits of padded vocabulary ids (>= ``vocab_size``) on this rank to -1e30."""
    start, end = _vocab_range(logits.shape[-1])
    if end <= vocab_size:
        return logits
    keep = torch.arange(start, end, device=logits.device) < vocab_size
    return logits.masked_fill(~keep, -1e30)


def vocab_parallel_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] over the vocabulary split across TP ranks, via megatron's
    ``vocab_parallel_cross_entropy`` (which returns -log p; it edits its input in place, so
    it gets a copy). ``logits`` [..., V/tp] float, ``targets`` [...] -> [...]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.clone(), targets)


def vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v with sums all-reduced over TP ranks
    (megatron's ``reduce_from_tensor_model_parallel_region``: identity backward)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as red

    zmax = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    z = logits - zmax
    e = z.exp()
    sum_e = red(e.sum(dim=-1))
    sum_ez = red((e * z).sum(dim=-1))
    return sum_e.log() - sum_ez / sum_e

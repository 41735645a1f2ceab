"""Weight formats for CPU inference (fp32, bf16, int8) applied in place to a torch model's linear layers."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specdec.config import WEIGHT_FORMATS

# Extra input columns that pin every row's dynamic-quantization range to exactly [-1, 1].
_RANGE_PAD = 8


class RowExactInt8Linear(nn.Module):
    """int8 weights (per output channel) with int8 activations quantized per row, row-independently.

    fbgemm's dynamic linear picks one activation range for the whole batch, so a row's result
    would depend on which other rows it is batched with: verifying k+1 positions at once would
    not reproduce one-at-a-time decoding. Each row is scaled to max |x| = 1 and two constant
    columns (-1 and +1, against zero weights) pin the batch range to [-1, 1]; the integer GEMM is
    then exact per row and the output is rescaled. Rows are bit-identical batched or alone.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        padded = torch.cat([weight, weight.new_zeros(out_features, _RANGE_PAD)], dim=1)
        scales = (padded.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 flags quantized tensor creation as deprecated; fbgemm's dynamic linear still needs it.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(padded, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        pad = torch.zeros(1, _RANGE_PAD)
        pad[0, 0], pad[0, 1] = -1.0, 1.0
        self.register_buffer("_pad", pad, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias, persistent=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        padded = torch.cat([rows / scale, self._pad.expand(rows.shape[0], -1)], dim=1)
        out = torch.ops.quantized.linear_dynamic(padded, self._packed, True) * scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)


class PackedFp32Linear(nn.Module):
    """fp32 linear whose weight is pre-packed into oneDNN's blocked layout.

    Same fp32 math as nn.Linear, but the packed GEMM costs nearly the same for 1 to ~8 rows,
    while eager F.linear switches from GEMV to a much slower GEMM path at 2+ rows; that switch
    is what makes verifying k+1 tokens expensive on CPU.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float().contiguous()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)


def _packed_linear_available() -> bool:
    try:
        probe = PackedFp32Linear(nn.Linear(8, 4))
        return bool(torch.allclose(probe(torch.ones(2, 8)), probe(torch.ones(1, 8)).expand(2, 4)))
    except (RuntimeError, AttributeError):
        return False


def _replace_linears(module: nn.Module, make) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            count += 1
        else:
            count += _replace_linears(child, make)
    return count


def _to_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    # In place, parameter by parameter: some loaders (GGUF) forbid model.float()/.to().
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)


def apply_weight_format(model: nn.Module, weight_format: str) -> nn.Module:
    """Convert the model in place; the same call must be used for every model being compared."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    _to_dtype(model, torch.bfloat16 if weight_format == "bf16" else torch.float32)
    if weight_format == "bf16":
        return model
    if weight_format == "fp32":
        if torch.backends.mkldnn.is_available() and _packed_linear_available():
            with torch.no_grad():
                _replace_linears(model, PackedFp32Linear)
        return model
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    # Tied input/output embeddings: the LM head gets its own int8 copy, the embedding stays fp32.
    with torch.no_grad():
        _replace_linears(model, RowExactInt8Linear)
    return model

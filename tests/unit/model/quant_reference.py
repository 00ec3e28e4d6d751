"""What Strata's quantized products compute, in float64 (the references of test_quant.py,
test_five_bit.py and test_six_bit.py)."""

import torch

from replicas.model.quant import GROUP_SIZE, QuantizedLinear


def strata_reference(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """What Strata's int4 and int8 kernels compute, with the sums in float64: x quantized per
    group of 32 in the layer's int8 passes (one or two) as the kernel does it in float32
    (``dx = max|v| / 127``, codes ``v * 127 / max|v|`` rounded to nearest even, a second pass on
    ``v - code * dx``), then
    ``d * sum_p dx_p * sum(q * qx_p) + m * sum(x)`` per group (int8: ``m = 0``), for codes,
    ``d`` and ``m`` read back from the layout by plain tensor ops."""
    codes, d, m = _strata_parts(layer)
    n = layer.out_features
    groups = x.float().reshape(len(x), -1, GROUP_SIZE)
    q = codes[:n].double().reshape(n, -1, GROUP_SIZE)
    qpart = 0
    for qx, dx in activation_passes(x, layer.passes):
        qpart = qpart + torch.einsum("ngk,rgk->rng", q, qx.double()) * dx.double()[:, None, :]
    y = (qpart * d[:n] + m[:n] * groups.double().sum(-1)[:, None, :]).sum(-1)
    return y if layer.bias is None else y + layer.bias.double()


def weight_reference(weight: torch.Tensor, x: torch.Tensor, passes: int) -> torch.Tensor:
    """What a product of a float ``weight`` [N, K] held exactly computes: the float64 sum over
    ``x`` quantized in ``passes`` as the kernels quantize it (``activation_passes``)."""
    w = weight.double().view(weight.shape[0], -1, GROUP_SIZE)
    return sum(
        torch.einsum("ngk,rgk->rng", w, qx.double()) * dx.double()[:, None, :]
        for qx, dx in activation_passes(x, passes)
    ).sum(-1)


def activation_passes(x: torch.Tensor, passes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x [R, K] quantized per group of 32 in ``passes`` int8 passes as Strata's kernels do it
    in float32: per pass, codes [R, K / 32, 32] and ``dx`` [R, K / 32]."""
    left, out = x.float().reshape(len(x), -1, GROUP_SIZE), []
    for _ in range(passes):
        amax = left.abs().amax(-1)
        dx = amax / 127
        # 127 / amax as the kernel divides (``127 / tensor`` is torch's reciprocal times 127,
        # which rounds differently and turns a tie the kernel does not see into one)
        inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        qx = torch.round(left * inverse[..., None])
        out.append((qx, dx))
        left = left - qx * dx[..., None]
    return out


def _strata_parts(layer: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K], d and m [N, K / 32] (float64) of a layer in Strata's int4 or int8 layout."""
    tiles, chunks, _ = layer.weight.shape
    if layer.scheme == "int8":  # chunks of 16 rows x 4 columns; d per row and group
        codes = layer.weight.view(tiles, chunks, 16, 4).permute(0, 2, 1, 3).reshape(tiles * 16, -1)
        d = layer.scales.permute(0, 2, 1).reshape(tiles * 16, -1).double()
        return codes, d, torch.zeros_like(d)
    c = layer.weight.view(tiles, chunks, 16, 4)
    codes = torch.stack((c & 15, c >> 4), dim=3).permute(0, 2, 1, 3, 4).reshape(tiles * 16, -1)
    scales = layer.scales
    if scales.dtype == torch.uint8:  # K-quant: per 8 groups D[16], -Dmin[16], then sc, mn
        pairs = scales[..., :64].contiguous().view(torch.float16).view(tiles, -1, 1, 2, 16)
        sc_mn = scales[..., 64:].reshape(tiles, -1, 8, 2, 16)
        scales = (pairs.double() * sc_mn.double()).view(tiles, -1, 2, 16)
    d, m = (scales[:, :, i].permute(0, 2, 1).reshape(tiles * 16, -1) for i in (0, 1))
    return codes, d.double(), m.double()


def _strata_built() -> bool:
    from replicas.model import native_stack

    return native_stack.load_error() is None

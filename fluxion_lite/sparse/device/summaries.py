"""Block selection on the compute device (the `gpu-sparse` baseline, Quest-style): block summaries mirrored there.

Per layer, K's per-dimension min/max over blocks of g tokens, [slots, Hkv, blocks, 2, D] bf16, kept up to date from
the new keys as they are produced (no host round trip).

Why bf16, and with directed rounding: the summaries are the device path's largest allocation after the pin cache
(1/8 of the K/V in fp32: 0.54 GB at 32K batch 1 on the Llama-3.1-8B shape), and bf16 halves them. The score must stay
an upper bound of q.k for every key of a block, so a stored min is rounded toward -inf and a stored max toward +inf
(round_down_bf16 / round_up_bf16), never to nearest. Keys that are bf16 already (the model dtype on the GPU) are
exact; fp32 keys (fp32 models, CPU tests) loosen the bound by at most one bf16 step per dimension. No fp32 option:
the host store keeps K in bf16 (round to nearest), and since rounding is monotone, RD(min k) <= RN(min k) =
min RN(k) (and likewise for max): the bf16 bound also covers the stored keys that attention actually reads, so fp32
summaries would buy precision the retrieved keys no longer have. The score is the same Quest bound the native top-k computes,
summed over the group's query heads: sum_d Q+_d max_d + Q-_d min_d with Q+ = sum_j max(q_j, 0), Q- = sum_j min(q_j, 0).
Pinned blocks (pinned.py) score above every other eligible block, so top-k takes them and fills the rest of its k
with the best unpinned blocks: the union the native pinned top-k makes.

With value_sums (a plan with the unread-background term, device_background.py) each layer also keeps per-128-token
value sums [slots, Hkv, blocks / (128 / g), D] fp32, the device mirror of the host store's VS: the sum of the
values as the store keeps them (bf16), so the term's mean values are the native one's.
"""
from __future__ import annotations

import torch

PINNED_SCORE = 3.0e38  # above any bound of real keys, finite: -inf still marks blocks that must not be chosen
SUMMARY_DTYPE = torch.bfloat16
VALUE_SUM_TOKENS = 128  # the value sums' block (the host store's FX_MAX_BLOCK)
VALUE_DTYPE = torch.bfloat16  # the host store's V: the sums add the values rounded to it


def _round_bf16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (any float dtype, cast to fp32) -> bf16, rounded toward +inf (up) or -inf: the bf16 value nearest x on that
    side. fp32 -> bf16 keeps the upper 16 bits; cutting the lower 16 rounds toward zero, which is already the wanted
    direction for x < 0 when rounding up and x >= 0 when rounding down; otherwise an inexact x steps one bf16 unit
    away from zero (+1 on the kept bits, sign-magnitude: also right across exponents, and max finite -> inf)."""
    bits = x.float().contiguous().view(torch.int32)
    cut = bits & -65536  # 0xFFFF0000: toward zero
    away = (bits >= 0) if up else (bits < 0)
    step = (((bits & 0xFFFF) != 0) & away).to(torch.int32) << 16  # one bf16 unit where inexact and away
    out = (cut + step).view(torch.float32)  # exact in bf16: the cast below does not round
    return torch.where(torch.isnan(x), x.float(), out).to(SUMMARY_DTYPE)  # a NaN stays NaN (its cut could be inf)


def round_down_bf16(x: torch.Tensor) -> torch.Tensor:
    """The largest bf16 value <= x (elementwise)."""
    return _round_bf16(x, up=False)


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= x (elementwise)."""
    return _round_bf16(x, up=True)


class DeviceSummaries:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, g: int, device: torch.device,
                 value_sums: bool = False):
        self.n_layers, self.hkv, self.d, self.g, self.device = n_layers, n_kv_heads, head_dim, g, device
        if value_sums and VALUE_SUM_TOKENS % g:
            raise ValueError(f"device value sums need a block size dividing {VALUE_SUM_TOKENS} (got g={g})")
        # per layer: [slot_cap, Hkv, block_cap, 2, D] bf16; grown (slots doubled, blocks by a quarter), never shrunk
        self._s: list[torch.Tensor] = [torch.empty(0, n_kv_heads, 0, 2, head_dim, dtype=SUMMARY_DTYPE, device=device)
                                       for _ in range(n_layers)]
        # with value_sums, per layer [slot_cap, Hkv, block_cap * g / 128, D] fp32, grown with _s; else empty
        self.value_sums = value_sums
        self._vs: list[torch.Tensor] = [torch.empty(0, n_kv_heads, 0, head_dim, dtype=torch.float32, device=device)
                                        for _ in range(n_layers)]
        self.version = 0  # bumped when a layer's tensor is reallocated (captured graphs address them)
        # block scores: the Quest bound of the summed query heads, or (midrange) q . (min + max) / 2 (the plan's scoring)
        self.midrange = False
        # what the last full reserve() left: (version, layers, slots, blocks) that every one of those layers holds
        self._room: tuple[int, int, int, int] | None = None

    def layer(self, layer: int) -> torch.Tensor:
        """The layer's summaries [slot_cap, Hkv, block_cap, 2, D] bf16 (device_kernels reads and updates them)."""
        return self._s[layer]

    def layer_values(self, layer: int) -> torch.Tensor:
        """The layer's value sums [slot_cap, Hkv, block_cap * g / 128, D] fp32 (value_sums only)."""
        return self._vs[layer]

    def bytes_used(self) -> int:
        """Device bytes allocated for the summaries and value sums (capacity, not only the blocks in use)."""
        return sum(t.numel() * t.element_size() for t in self._s + self._vs)

    def _ensure(self, layer: int, slot: int, n_blocks: int) -> torch.Tensor:
        s = self._s[layer]
        if slot < s.shape[0] and n_blocks <= s.shape[2]:
            return s
        slots = max(slot + 1, s.shape[0] if slot < s.shape[0] else 2 * s.shape[0], 1)
        # blocks grow by a quarter, not doubled: a 32K context that decodes past 2048 blocks (g=16) doubled to 4096,
        # 1.07 GB of (then fp32) summaries on the 8B shape where 0.54 GB were in use (a regrowth is a copy and a new
        # graph capture, once per quarter more context)
        blocks = max(n_blocks, s.shape[2] + s.shape[2] // 4 if n_blocks > s.shape[2] else s.shape[2], 64)
        blocks = -(-blocks // 64) * 64
        grown = torch.zeros(slots, self.hkv, blocks, 2, self.d, dtype=SUMMARY_DTYPE, device=self.device)
        grown[: s.shape[0], :, : s.shape[2]] = s
        self._s[layer] = grown
        if self.value_sums:  # blocks is a multiple of 64, so of 128 / g: the sums cover the same tokens
            vs = self._vs[layer]
            vgrown = torch.zeros(slots, self.hkv, blocks * self.g // VALUE_SUM_TOKENS, self.d, dtype=torch.float32,
                                 device=self.device)
            vgrown[: vs.shape[0], :, : vs.shape[2]] = vs
            self._vs[layer] = vgrown
        self.version += 1
        return grown

    def reserve(self, n_layers: int, slot: int, n_blocks: int) -> None:
        """Room for `slot` and `n_blocks` blocks in every layer, ahead of a captured step that must not grow them."""
        room = self._room
        if (room is not None and room[0] == self.version and n_layers <= room[1] and slot < room[2]
                and n_blocks <= room[3]):
            return  # the usual decode step: no layer to look at (called once per step)
        for layer in range(n_layers):
            self._ensure(layer, slot, n_blocks)
        layers = self._s[:n_layers]
        self._room = (self.version, n_layers, min(t.shape[0] for t in layers), min(t.shape[2] for t in layers))

    def append_chunk(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Keys k [n, Hkv, D] at positions start..start+n-1 of one sequence (a prefill chunk); with value_sums also
        its values v [n, Hkv, D]."""
        g, n = self.g, k.shape[0]
        if n == 0:
            return
        off, b0 = start % g, start // g
        nb = -(-(off + n) // g)
        s = self._ensure(layer, slot, b0 + nb)
        if self.value_sums:
            if v is None:
                raise ValueError("append_chunk: these summaries keep value sums, so the chunk's values are needed")
            self._add_values(layer, slot, start, v)
        exact = k.dtype == SUMMARY_DTYPE  # bf16 keys: their min/max are bf16 values already, nothing to round
        kk = k if exact else k.float()
        tail = nb * g - off - n
        if off or tail:  # pad to whole blocks with copies of the chunk's first / last key: both lie in the block they
            # pad (the first and the last), so its min and max do not change; one copy instead of two filled buffers
            kk = torch.cat([kk[:1].expand(off, -1, -1), kk, kk[-1:].expand(tail, -1, -1)])
        # a chunk of whole blocks (the usual 8192-token chunk at a block start) is read in place: a prefill chunk
        # runs this per layer in every mixed step. amin and amax, not aminmax: on the CPU its bf16 reduction took ~6x
        # as long as the two (bench/summary_append.py)
        blocks = kk.reshape(nb, g, self.hkv, self.d)
        mins, maxs = blocks.amin(1), blocks.amax(1)  # [nb, Hkv, D] each
        if off:  # the first block already holds earlier tokens (bf16 values, exact in fp32)
            mins[0] = torch.minimum(mins[0], s[slot, :, b0, 0].to(kk.dtype))
            maxs[0] = torch.maximum(maxs[0], s[slot, :, b0, 1].to(kk.dtype))
        if not exact:
            mins, maxs = round_down_bf16(mins), round_up_bf16(maxs)
        s[slot, :, b0 : b0 + nb] = torch.stack([mins, maxs], dim=2).transpose(0, 1)

    def _add_values(self, layer: int, slot: int, start: int, v: torch.Tensor) -> None:
        """Values v [n, Hkv, D] at positions start.. of one sequence into its 128-token sums (room ensured); a block
        whose first token is among them starts from zero, as the host store's do."""
        c, n = VALUE_SUM_TOKENS, v.shape[0]
        off, b0 = start % c, start // c
        nb = -(-(off + n) // c)
        vv = v.to(VALUE_DTYPE).float()
        padded = torch.cat([vv.new_zeros(off, self.hkv, self.d), vv, vv.new_zeros(nb * c - off - n, self.hkv, self.d)])
        sums = padded.view(nb, c, self.hkv, self.d).sum(1).transpose(0, 1)  # [Hkv, nb, D]
        vs = self._vs[layer]
        if off:  # the first block already holds earlier tokens' sum
            sums[:, 0] += vs[slot, :, b0]
        vs[slot, :, b0: b0 + nb] = sums

    def append_values(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, v: torch.Tensor) -> None:
        """One new value per sequence (value_sums; room reserved): slots, pos [B] int64, v [B, Hkv, D]. No host
        sync: the captured device step calls it next to device_kernels.append_token."""
        vs = self._vs[layer]
        blk = pos // VALUE_SUM_TOKENS
        first = (pos % VALUE_SUM_TOKENS == 0)[:, None, None]  # [B, 1, 1]: a new block, its old sum is stale
        vv = v.to(VALUE_DTYPE).float()
        vs[slots, :, blk] = torch.where(first, vv, vs[slots, :, blk] + vv)

    def append_tokens(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, max_slot: int, max_pos: int,
                      k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """One new key per sequence: slots, pos [B] int64 (device), k [B, Hkv, D]; max_* are host ints for growth;
        with value_sums also the values v [B, Hkv, D]."""
        s = self._ensure(layer, max_slot, max_pos // self.g + 1)
        if self.value_sums:
            if v is None:
                raise ValueError("append_tokens: these summaries keep value sums, so the tokens' values are needed")
            self.append_values(layer, slots, pos, v)
        blk = pos // self.g
        first = (pos % self.g == 0)[:, None, None]  # [B, 1, 1]: a new block starts, old contents are stale
        # bf16 keys (the model dtype on the GPU): min/max of bf16 values are bf16 values, so no rounding and no fp32
        # copies (a handful of kernels instead of ~40: this runs per layer in every eager step)
        exact = k.dtype == SUMMARY_DTYPE
        cur = s[slots, :, blk] if exact else s[slots, :, blk].float()  # [B, Hkv, 2, D]
        kk = k if exact else k.float()
        # the stored bounds are bf16 values, so rounding min(stored, k) = min(stored, rounded k): the block's summary
        # stays the directed rounding of its exact min/max however its tokens arrived
        mins = torch.where(first, kk, torch.minimum(cur[:, :, 0], kk))
        maxs = torch.where(first, kk, torch.maximum(cur[:, :, 1], kk))
        if not exact:
            mins, maxs = round_down_bf16(mins), round_up_bf16(maxs)
        s[slots, :, blk] = torch.stack([mins, maxs], dim=2)

    def scores(self, layer: int, qg: torch.Tensor, slots: torch.Tensor, lo_blk: torch.Tensor, hi_blk: torch.Tensor,
               n_blocks: int, pinned: torch.Tensor | None = None) -> torch.Tensor:
        """qg [B, Hkv, r, D]; slots [B]; lo_blk, hi_blk [B] or [B, Hkv]: eligible blocks are [lo, hi); pinned bool
        [B, Hkv, >= n_blocks] or None. Returns fp32 [B, Hkv, NB]: the bound (or the midrange score), PINNED_SCORE
        for an eligible pinned block, -inf for an ineligible one. No host sync: usable inside a captured graph."""
        s = self._s[layer][:, :, :n_blocks].index_select(0, slots).float()  # [B, Hkv, NB, 2, D]
        q = qg.float()
        if self.midrange:  # max . q/2 + min . q/2 = q . (min + max) / 2
            q_pos = q_neg = q.sum(2) * 0.5  # [B, Hkv, D]
        else:
            q_pos, q_neg = q.clamp(min=0).sum(2), q.clamp(max=0).sum(2)  # [B, Hkv, D]
        scores = torch.einsum("bhd,bhnd->bhn", q_pos, s[..., 1, :]) + torch.einsum("bhd,bhnd->bhn", q_neg, s[..., 0, :])
        blk = torch.arange(n_blocks, device=qg.device)
        lo = lo_blk.reshape(lo_blk.shape[0], -1, 1)  # [B, 1 or Hkv, 1]
        hi = hi_blk.reshape(hi_blk.shape[0], -1, 1)
        eligible = (blk >= lo) & (blk < hi)  # [B, 1 or Hkv, NB]
        if pinned is not None:
            scores = torch.where(pinned[..., :n_blocks], torch.full_like(scores, PINNED_SCORE), scores)
        return scores.masked_fill(~eligible, float("-inf"))

    def select(self, layer: int, qg: torch.Tensor, slots: torch.Tensor, lo_blk: torch.Tensor, hi_blk: torch.Tensor,
               n_blocks: int, k_max: int, pinned: torch.Tensor | None = None) -> torch.Tensor:
        """scores() then top-k: int32 [B, Hkv, k_max] block ids, highest score first; only the first
        min(k, hi - lo) of a row are meaningful."""
        scores = self.scores(layer, qg, slots, lo_blk, hi_blk, n_blocks, pinned)
        return scores.topk(min(k_max, n_blocks), dim=-1).indices.to(torch.int32)

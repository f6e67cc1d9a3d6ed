"""Launch configurations of the token-gather kernels, shared by every launcher.

:class:`BlockSizes` is what a caller may choose; :func:`default_block_sizes` is the
table the torch and JAX launchers both read, so that one GPU gets one configuration
whichever framework launches the kernels (the precondition of their bitwise-equal
forwards). Pure Python: importing this module imports nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockSizes", "DEFAULT_BLOCK_SIZES", "SAFE_BLOCK_SIZES", "TUNED_SHARED_MEMORY",
           "MAX_ROWS_PER_TILE", "block_shared_memory", "default_block_sizes"]

MAX_ROWS_PER_TILE = 32  # rowbits is an int32 bitmask: one bit per query row of a tile


@dataclass(frozen=True)
class BlockSizes:
    """Launch configuration of the forward and backward kernels.

    ``block_m``: target matrix rows ((query row, head) pairs) of a forward program; it
    fixes the tile height T = min(32, block_m // G_pad) (G_pad: G = Hq/Hkv rounded up
    to a power of two) and so the route unions that forward and backward share.
    ``block_k``: union IDs gathered per step. ``backward_block_m`` / ``backward_block_k``:
    the same for the backward. By default (``backward_rows_per_tile`` None) a backward
    program keeps all G_pad heads of a tile and takes T_b = backward_block_m // G_pad of
    its rows, each forward tile cut into T / T_b backward tiles whose unions come out of
    the forward's (no second sort); ``backward_rows_per_tile`` sets T_b instead, heads then
    split over several programs when T_b * G_pad exceeds ``backward_block_m``.
    Block sizes are powers of two >= 16; warps and stages positive ints. At a padded head
    dim of 256, backward programs of 64+ pairs need ``backward_block_k`` >= 64
    (:func:`qsa_triton.plan.min_backward_block_k`; plans refuse narrower chunks there).

    ``flatten_heads``: where G is not a power of two, every program (forward and
    backward) takes ``block_m`` consecutive (query row, head) pairs instead of T rows x
    G_pad heads, so no matrix row is head padding; a program then spans at most
    ``(block_m - 1) // G + 2`` query rows and the backward walks the forward's programs.
    """

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    backward_block_m: int = 64
    backward_block_k: int = 64
    backward_num_warps: int = 8
    backward_num_stages: int = 1
    backward_rows_per_tile: int | None = None
    flatten_heads: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_k", "backward_block_m", "backward_block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages", "backward_num_warps", "backward_num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")
        rows = self.backward_rows_per_tile
        if rows is not None and (not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS_PER_TILE
                                 or rows & (rows - 1)):
            raise ValueError("BlockSizes.backward_rows_per_tile must be None or a power of two "
                             f"in [1, {MAX_ROWS_PER_TILE}], got {rows!r}")
        if not isinstance(self.flatten_heads, bool):
            raise TypeError(f"BlockSizes.flatten_heads must be a bool, got {self.flatten_heads!r}")


# Tuned on H200 for D=256 bf16 (S=32768, (24,2), QSA routes); see docs/benchmarks.md.
# Flat programs of 128 (row, head) pairs forward and backward over 64-ID chunks: the
# backward's dK/dV atomic traffic halves with twice the matrix rows per program.
DEFAULT_BLOCK_SIZES = BlockSizes(num_stages=3, backward_block_k=64, backward_num_stages=1,
                                 flatten_heads=True)
# Everywhere else (fp32, D <= 128, GPUs with less shared memory, the interpreter).
SAFE_BLOCK_SIZES = BlockSizes(block_m=64, block_k=32, num_warps=4, num_stages=2,
                              backward_block_m=32, backward_block_k=32,
                              backward_num_warps=4, backward_num_stages=1)

# Shared memory per program of DEFAULT_BLOCK_SIZES at D = 256, 16-bit, compiled for
# sm_90a (unit strides along D): the forward's 197120 bytes (3 stages) is the larger.
TUNED_SHARED_MEMORY = 197120


def block_shared_memory(capability: tuple[int, int]) -> int:
    """Bytes of shared memory one block may opt into on a GPU of compute ``capability``,
    for frameworks that cannot ask the driver: 227 KiB on SM90/SM100 (majors 9 and 10),
    163 KiB on SM80/SM87, 99 KiB elsewhere (SM86, SM89, SM120, any capability not named)."""
    if capability[0] in (9, 10):
        return 227 * 1024
    if tuple(capability) in ((8, 0), (8, 7)):
        return 163 * 1024
    return 99 * 1024


def default_block_sizes(capability: tuple[int, int] | None, head_dim: int, dtype: str,
                        shared_memory: int | None = None) -> BlockSizes:
    """The configuration used when a caller passes none.

    Args:
        capability: CUDA compute capability ``(major, minor)``; None where the kernels
            do not run on a CUDA GPU (Triton's interpreter).
        head_dim: D.
        dtype: the inputs' dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
        shared_memory: bytes of shared memory a block may opt into, where the
            framework can say (torch can, JAX cannot); None: :func:`block_shared_memory`.

    Returns :data:`DEFAULT_BLOCK_SIZES` for 16-bit inputs at D > 128 on SM90+ GPUs whose
    blocks may take :data:`TUNED_SHARED_MEMORY` bytes, else :data:`SAFE_BLOCK_SIZES`
    (fp32 dots run without tensor cores and need twice the shared memory).
    """
    if capability is None or tuple(capability) < (9, 0) or head_dim <= 128 or dtype == "float32":
        return SAFE_BLOCK_SIZES
    if shared_memory is None:
        shared_memory = block_shared_memory(capability)
    return DEFAULT_BLOCK_SIZES if shared_memory >= TUNED_SHARED_MEMORY else SAFE_BLOCK_SIZES

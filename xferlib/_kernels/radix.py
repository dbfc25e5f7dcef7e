"""The batch sort above one tile: a device-wide LSD radix sort of (key, position) pairs, 8 bits
a pass, queued without a host sync (so a step that sorts can be captured in a CUDA graph).

One launch counts every pass's digits (``radix_histogram``, which also checks the keys);
then one launch per pass (``radix_pass``, the one-sweep design): each block takes the next
tile of 2,048 positions (512 or 1,024 with fewer keys a thread: ``RADIX_ITEM_CHOICES``),
ranks its keys by digit (stable: warp by warp, item by item), finds how many keys of each
digit earlier tiles hold by a decoupled look-back over their published counts, and scatters
its keys and positions to their places. Equal keys keep batch order (every pass is stable),
as the one-block tile sort does. A 23-bit key range takes three passes; the merge sort it
replaces took one launch per doubling of the run length (five at 65,536 positions, eight at
426k).

Every pass reads and writes positions below ``n`` only; a key outside ``[0, n_rows)`` is
reported (atomic minimum into ``first_bad``) and sorted as the largest key the bits allow,
so no input can move a write out of its array.
"""

from xferlib._kernels._declare import KernelDecl, defines
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.rows import BLOCK_SCAN, INDEX_TYPES

RADIX_BITS = 8
RADIX_BINS = 1 << RADIX_BITS
RADIX_THREADS = 256  # one thread per digit in the block's scans
RADIX_ITEM_CHOICES = (2, 4, 8)  # keys a thread ranks per tile: tiles of 512, 1,024, 2,048
RADIX_ITEMS = 8  # the largest tile; smaller tiles give a small batch more blocks (radix_items)
RADIX_MAX_PASSES = 4  # keys below 2^32
RADIX_LOOK = 16  # earlier tiles' counts read at once by the look-back
# A tile's published count: a flag in the top two bits (0 not yet, A its own count, P its
# count with every earlier tile's), the count below; so n stays under 2^30.
RADIX_MAX_N = (1 << 30) - 1

_HEAD = defines(RADIX_BITS=RADIX_BITS, RADIX_BINS=RADIX_BINS, RADIX_THREADS=RADIX_THREADS,
                RADIX_MAX_PASSES=RADIX_MAX_PASSES, RADIX_LOOK=RADIX_LOOK) + r"""
typedef long long i64;
#define RADIX_WARPS (RADIX_THREADS / 32)
#define FLAG_A 0x40000000u
#define FLAG_P 0x80000000u
#define COUNT_MASK 0x3fffffffu

// The key a pass sorts: the index itself, or for one outside [0, n_rows) the largest key
// of `bits` bits (reported by the histogram; the batch is then rejected as a whole).
template <typename I>
__device__ __forceinline__ unsigned int radix_key(I x, i64 n_rows, unsigned int pad) {
    return ((i64)x < 0 || (i64)x >= n_rows) ? pad : (unsigned int)x;
}

// Position of lane's first key in a tile of RADIX_THREADS * ITEMS: warp w owns positions
// [w * 32 * ITEMS, (w + 1) * 32 * ITEMS) of it, item i of lane l at i * 32 + l, so loads
// coalesce and (item, lane) order is batch order.
template <int ITEMS>
__device__ __forceinline__ i64 tile_first(unsigned int tile) {
    return (i64)tile * (RADIX_THREADS * ITEMS) + (i64)(threadIdx.x >> 5) * 32 * ITEMS
           + (threadIdx.x & 31);
}

// The lanes of the warp whose d (a digit, or RADIX_BINS for a lane without a key) equals
// this lane's: a ballot per bit (what match.any finds, from instructions of full rate).
__device__ __forceinline__ unsigned int digit_peers(unsigned int d) {
    unsigned int peers = 0xffffffffu;
    #pragma unroll
    for (int b = 0; b <= RADIX_BITS; ++b) {
        const unsigned int bit = (d >> b) & 1u;
        const unsigned int vote = __ballot_sync(0xffffffffu, bit);
        peers &= bit ? vote : ~vote;
    }
    return peers;
}

__device__ __forceinline__ unsigned int radix_pad(int bits) {
    return bits >= 32 ? 0xffffffffu : ((1u << bits) - 1u);
}
"""

# hist[p * RADIX_BINS + d]: how many keys have digit d in pass p (zeroed by the caller), and
# first_bad[0]: the first position whose key is out of range (an atomic minimum). A block
# per tile, its keys loaded as the passes load them (all loads in flight at once).
RADIX_HISTOGRAM = KernelDecl(
    "radix_histogram", "template <typename I, int ITEMS>",
    (("const I* __restrict__", "idx"), ("i64", "n"), ("i64", "n_rows"), ("int", "bits"),
     ("int", "passes"), ("unsigned int* __restrict__", "hist"),
     ("unsigned long long* __restrict__", "first_bad")),
    r"""
    __shared__ unsigned int local[RADIX_MAX_PASSES * RADIX_BINS];
    for (int i = threadIdx.x; i < RADIX_MAX_PASSES * RADIX_BINS; i += blockDim.x) local[i] = 0;
    const i64 first = tile_first<ITEMS>(blockIdx.x);
    const unsigned int pad = radix_pad(bits);
    unsigned int k[ITEMS];
    unsigned long long bad = ~0ull;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const i64 p = first + 32 * i;
        k[i] = 0;
        if (p < n) {
            const I x = idx[p];
            if (((i64)x < 0 || (i64)x >= n_rows) && bad == ~0ull) bad = (unsigned long long)p;
            k[i] = radix_key(x, n_rows, pad);
        }
    }
    if (bad != ~0ull) atomicMin(&first_bad[0], bad);
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + 32 * i >= n) continue;
        for (int p = 0; p < passes; ++p)
            atomicAdd(&local[p * RADIX_BINS + ((k[i] >> (p * RADIX_BITS)) & (RADIX_BINS - 1))], 1u);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < passes * RADIX_BINS; i += blockDim.x)
        if (local[i]) atomicAdd(&hist[i], local[i]);""",
    launch_bounds="__launch_bounds__(RADIX_THREADS)")

# One stable pass over the digit at `shift`. The first pass reads the batch (`idx`, keys
# checked as the histogram did, positions its own); later ones the last pass's pairs
# (`keys_in`, `vals_in`). The last pass writes int64 positions to `perm_out` (else 32-bit
# ones to `vals_out`). `hist`: this pass's digit counts; `status`: a word per (tile, digit),
# zeroed by the caller; `counter`: the next tile to take, zeroed by the caller (blocks take
# tiles in the order they start, so a tile waits only on tiles whose blocks are running).
RADIX_PASS = KernelDecl(
    "radix_pass", "template <typename I, int ITEMS>",
    (("const I* __restrict__", "idx"), ("const unsigned int* __restrict__", "keys_in"),
     ("const unsigned int* __restrict__", "vals_in"), ("i64", "n"), ("i64", "n_rows"),
     ("int", "bits"), ("int", "shift"), ("const unsigned int* __restrict__", "hist"),
     ("unsigned int*", "status"), ("unsigned int* __restrict__", "counter"),
     ("unsigned int* __restrict__", "keys_out"), ("unsigned int* __restrict__", "vals_out"),
     ("i64* __restrict__", "perm_out")),
    r"""
    __shared__ unsigned int warp_count[RADIX_WARPS][RADIX_BINS];
    __shared__ unsigned int tile_base[RADIX_BINS], digit_start[RADIX_BINS];
    constexpr int TILE = RADIX_THREADS * ITEMS;
    __shared__ unsigned int sorted_keys[TILE], sorted_vals[TILE];
    __shared__ unsigned int warp_sums[32];
    __shared__ unsigned int tile_s;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    if (t == 0) tile_s = atomicAdd(counter, 1u);
    for (int i = t; i < RADIX_WARPS * RADIX_BINS; i += RADIX_THREADS)
        (&warp_count[0][0])[i] = 0;
    __syncthreads();
    const unsigned int tile = tile_s;
    const i64 first = tile_first<ITEMS>(tile);
    const unsigned int pad = radix_pad(bits);
    const unsigned int lower = (1u << lane) - 1u;
    unsigned int k[ITEMS], v[ITEMS], rank[ITEMS];
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const i64 p = first + 32 * i;
        k[i] = 0; v[i] = 0;
        if (p < n) {
            if (idx != nullptr) { k[i] = radix_key(idx[p], n_rows, pad); v[i] = (unsigned int)p; }
            else { k[i] = keys_in[p]; v[i] = vals_in[p]; }
        }
    }
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const bool live = first + 32 * i < n;
        const unsigned int d = live ? (k[i] >> shift) & (RADIX_BINS - 1) : RADIX_BINS;
        const unsigned int peers = digit_peers(d);
        unsigned int before = 0;
        if (live) {
            before = warp_count[warp][d];  // every peer reads it before the leader adds
            rank[i] = before + __popc(peers & lower);
        }
        __syncwarp();
        if (live && (peers & lower) == 0) warp_count[warp][d] = before + __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // thread d: digit d's count in each warp turned into the warps' exclusive prefix
    const int d = t;
    unsigned int total = 0;
    #pragma unroll
    for (int w = 0; w < RADIX_WARPS; ++w) {
        const unsigned int c = warp_count[w][d];
        warp_count[w][d] = total;
        total += c;
    }
    // published at once for the look-back of later tiles (below)
    volatile unsigned int* mine = status + (i64)tile * RADIX_BINS + d;
    *mine = (tile == 0 ? FLAG_P : FLAG_A) | total;
    const unsigned int bucket = block_exclusive_scan(hist[d], warp_sums);
    const unsigned int local = block_exclusive_scan(total, warp_sums);
    digit_start[d] = local;  // digit d's first place in the tile
    __syncthreads();
    // The tile sorted by digit in shared memory first: its writes to global memory then go
    // out in runs of adjacent addresses (stores straight from the ranks touched up to 32
    // lines each).
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + 32 * i >= n) continue;
        const unsigned int digit = (k[i] >> shift) & (RADIX_BINS - 1);
        const unsigned int at = digit_start[digit] + warp_count[warp][digit] + rank[i];
        sorted_keys[at] = k[i];
        sorted_vals[at] = v[i];
    }
    // decoupled look-back: earlier tiles' counts added until one that carries every tile
    // before it (P), then the sum with this tile's published as P. Earlier tiles are read
    // RADIX_LOOK at a time (independent loads: one round trip to L2 for each window, not
    // one per tile); a tile not yet published is read again.
    unsigned int before = 0;
    if (tile != 0) {
        i64 next = (i64)tile - 1;  // the nearest earlier tile not yet added
        bool done = false;
        while (!done) {
            unsigned int seen[RADIX_LOOK];
            #pragma unroll
            for (int u = 0; u < RADIX_LOOK; ++u)  // before tile 0: a P of nothing
                seen[u] = next - u >= 0 ? ((volatile unsigned int*)status)[
                    (next - u) * RADIX_BINS + d] : FLAG_P;
            int added = 0;
            #pragma unroll
            for (int u = 0; u < RADIX_LOOK; ++u) {
                if (done || added < u || (seen[u] & (FLAG_A | FLAG_P)) == 0) continue;
                before += seen[u] & COUNT_MASK;
                added = u + 1;
                done = (seen[u] & FLAG_P) != 0;
            }
            next -= added;
        }
        *mine = FLAG_P | (before + total);
    }
    tile_base[d] = bucket + before - local;  // + the place in the tile (mod 2^32)
    __syncthreads();
    const i64 left = n - (i64)tile * TILE;
    const int count = left < TILE ? (int)left : TILE;
    for (int j = t; j < count; j += RADIX_THREADS) {
        const unsigned int key = sorted_keys[j];
        const unsigned int dest = tile_base[(key >> shift) & (RADIX_BINS - 1)] + j;
        keys_out[dest] = key;
        if (perm_out != nullptr) perm_out[dest] = (i64)sorted_vals[j];
        else vals_out[dest] = sorted_vals[j];
    }""",
    launch_bounds="__launch_bounds__(RADIX_THREADS)")


RADIX_KERNEL = _HEAD + BLOCK_SCAN + RADIX_HISTOGRAM.source() + RADIX_PASS.source()
RADIX_MODULE = KernelModule(
    "radix", RADIX_KERNEL,
    tuple(d.instance(I, items) for I in INDEX_TYPES.values() for items in RADIX_ITEM_CHOICES
          for d in (RADIX_HISTOGRAM, RADIX_PASS)))


def key_bits(num_keys: int) -> int:
    """Bits of keys below ``num_keys`` (at least one): what the sorts rank by."""
    return max(1, int(num_keys - 1).bit_length())


def radix_key_passes(num_keys: int) -> int:
    """Passes of :data:`RADIX_BITS` bits that sort keys below ``num_keys``."""
    return -(-key_bits(num_keys) // RADIX_BITS)


def radix_items(n: int) -> int:
    """Keys a thread ranks in a sort of ``n`` keys: smaller tiles give a small sort more
    blocks to spread over the SMs, larger ones cut a large sort's look-back. One H200, each
    sort in a CUDA graph (us for items 8 / 4 / 2): 4,096 keys 22.8 / 17.1 / 15.0; 20,480
    24.2 / 20.2 / 18.6; 65,536 25.8 / 23.8 / 26.0; 212,992 32.4 / 33.3 / 45.0; 425,984
    41.2 / 53.9 / 77.0."""
    return 2 if n <= 32_768 else 4 if n <= 131_072 else 8


def radix_tiles(n: int, items: int = RADIX_ITEMS) -> int:
    """Tiles (blocks of each launch) of a sort of ``n`` keys, ``items`` keys a thread."""
    return max(1, -(-int(n) // (RADIX_THREADS * items)))


def radix_status_words(n: int, passes: int, items: int = RADIX_ITEMS) -> int:
    """Words of the zeroed scratch one sort of ``n`` keys uses: every pass's digit counts,
    its tile counter and its (tile, digit) look-back words."""
    tiles = radix_tiles(n, items)
    return passes * (RADIX_BINS + 1 + tiles * RADIX_BINS)

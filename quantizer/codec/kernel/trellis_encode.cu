// The project's own Viterbi tile encoder for EXL3 (issue 39; docs/encoder.md, "Our tile kernel").
//
// One 16x16 tile is a tail-biting ring of L = 256 positions. The state after position p is 16 bits; each
// step shifts K new bits in at the bottom, so the cost of a state depends only on its low 16 - K bits
// ("edge" e), and its 2^K predecessors are the states whose top K bits are any k: state s = (k << (16-K)) | e,
// predecessor edge s >> K. The search runs twice, as exllamav3 1.6.5 does (docs/exl3-format.md, encoder):
// pass 1 starts at the ring's middle without constraint and traces back to position 0 to find a boundary
// edge; pass 2 starts at position 0 from that edge and ends in it.
//
// What differs from exllamav3's generic kernel, and why the codes stay the same:
// - every thread owns a fixed run of edges, so the decoded codebook values of its 2^16 / NT states are
//   computed once per kernel launch and kept in registers;
// - the forward pass keeps only the minimum cost per edge (half2 sub, fma, min per pair of edges and
//   candidate), no argmin index; each step's minima go to a global history;
// - the traceback recomputes, for the edge on the path, the 2^K candidate costs with the same fp16 operations
//   (sub, then fma with the stored predecessor cost; a plain square at step 0) and takes the smallest cost,
//   lowest k first: the same value and the same first-index tie rule as a running strict-less argmin;
// - at K 1 and 2, where a step's minima are 64 and 32 KiB and writing them bounds the search, the history
//   keeps every other step's only; the traceback recomputes a skipped step's minimum from the step before
//   it with the forward pass's operations (a minimum of the same values in any order is the same value).
// The final-edge choice after pass 1 uses exllamav3's tie order over equal costs (bit-reversed warp, then
// bit-reversed lane, then 1024-state stripe), written out below as `edge_rank`.

//
// The per-thread work (decode, one forward step, the final-edge key, one traceback candidate) is written as
// plain functions and the kernel only orders them between barriers. Built with TRELLIS_HOST defined (and a
// host definition of the fp16 types and intrinsics, tests/encoder_kernel_host.cpp), the same functions run
// on a CPU, one simulated thread after another, so the search can be checked without a GPU.

#ifdef TRELLIS_HOST
#define TE_FN inline
#else
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#define TE_FN __device__ __forceinline__
#endif
#include <cstdint>

namespace trellis {

constexpr int L = 256;          // positions per tile (ring)
constexpr int NT = 512;         // threads per block; all run the forward pass, warp 0 also traces back
constexpr uint32_t NO_KEY = 0xffffffffu;

template <int K>
struct Geometry
{
    static constexpr int EDGES = 65536 >> K;                  // cost entries per step
    static constexpr int E = EDGES / NT;                      // edges per thread, a contiguous run
    static constexpr int P = E / 2;                           // edge pairs (one half2 each)
    static constexpr int Q = 1 << K;                          // predecessors per edge
    static constexpr int KSHIFT = 16 - 2 * K;                 // where k sits in a predecessor edge
    static constexpr int G = (E >> K) > 0 ? (E >> K) : 1;     // distinct predecessor groups (e >> K) per thread
    static constexpr int STRIDE = K <= 2 ? 2 : 1;             // the history keeps every STRIDE-th step's minima
    static constexpr int ROWS = L / STRIDE;                   // history rows per block
    static constexpr int UNITS = E / 8;                       // 16-byte units in a thread's run of minima
    static constexpr int SPREAD = UNITS >= 8 ? 0 : UNITS == 4 ? 1 : 2;  // log2(8 / UNITS), see cost_slot
    static_assert(E >= 2 && (E % 2) == 0 && KSHIFT >= 0, "K outside this thread layout");
};

// Codebooks (docs/exl3-format.md, decode step 4): 0 = 3INST, 1 = mcg, 2 = mul1
template <int CB>
TE_FN half decode_state(uint32_t s)
{
    if constexpr (CB == 2)
    {
        const uint32_t x = s * 0x83DCD12Du;
        const uint32_t bytes = (x & 0xffu) + ((x >> 8) & 0xffu) + ((x >> 16) & 0xffu) + (x >> 24);
        // 0x6400 + c is the fp16 bit pattern of 1024 + c (c <= 1020); one fused rounding
        const half h = __ushort_as_half((unsigned short) (0x6400u + bytes));
        return __hfma(h, __ushort_as_half(0x1eee), __ushort_as_half(0xc931));
    }
    else
    {
        uint32_t x = CB == 1 ? s * 0xCBAC1FEDu : s * 89226354u + 64248484u;
        x = (x & 0x8fff8fffu) ^ 0x3b603b60u;
        return __hadd(__ushort_as_half((unsigned short) (x & 0xffffu)), __ushort_as_half((unsigned short) (x >> 16)));
    }
}

TE_FN half inf_half() { return __ushort_as_half(0x7c00); }

// N consecutive halves from shared memory into registers, in the widest aligned pieces
template <int N>
TE_FN void load_halves(half (&dst)[N], const half* src)
{
#ifdef TRELLIS_HOST
    for (int i = 0; i < N; ++i) dst[i] = src[i];
#else
    if constexpr (N % 8 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 8; ++i)
            *reinterpret_cast<uint4*>(&dst[8 * i]) = reinterpret_cast<const uint4*>(src)[i];
    }
    else if constexpr (N % 4 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 4; ++i)
            *reinterpret_cast<uint2*>(&dst[4 * i]) = reinterpret_cast<const uint2*>(src)[i];
    }
    else if constexpr (N % 2 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 2; ++i)
            *reinterpret_cast<uint32_t*>(&dst[2 * i]) = reinterpret_cast<const uint32_t*>(src)[i];
    }
    else
    {
        #pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = src[i];
    }
#endif
}

template <int P>
TE_FN void store_pairs(half* dst, const half2 (&src)[P])
{
#ifdef TRELLIS_HOST
    for (int i = 0; i < P; ++i) { dst[2 * i] = __low2half(src[i]); dst[2 * i + 1] = __high2half(src[i]); }
#else
    if constexpr (P % 4 == 0)
    {
        #pragma unroll
        for (int i = 0; i < P / 4; ++i)
            reinterpret_cast<uint4*>(dst)[i] = *reinterpret_cast<const uint4*>(&src[4 * i]);
    }
    else if constexpr (P % 2 == 0)
    {
        #pragma unroll
        for (int i = 0; i < P / 2; ++i)
            reinterpret_cast<uint2*>(dst)[i] = *reinterpret_cast<const uint2*>(&src[2 * i]);
    }
    else
    {
        #pragma unroll
        for (int i = 0; i < P; ++i) reinterpret_cast<half2*>(dst)[i] = src[i];
    }
#endif
}

// Where edge e's minimum sits in the shared cost buffers. A thread stores its run of E minima as UNITS
// 16-byte units, and a warp stores 16-byte pieces eight threads at a time: where a run is 2, 4 or 8 units
// (K 3, 2, 1) those eight threads' pieces would fall in 4, 2 or 1 of the 8 bank groups, so every store
// would wait 2, 4 or 8 times over. Each thread's units are therefore XOR-permuted by its index, spreading
// the eight threads over all 8 groups; loads of any aligned run of 8 units stay within one permuted run.
// Only the place changes, never a value: the history in global memory keeps the plain order.
template <int K>
TE_FN int cost_slot(int e)
{
    using Gm = Geometry<K>;
    if constexpr (Gm::UNITS < 2) return e;
    else
    {
        const int unit = e >> 3;
        const int owner = unit / Gm::UNITS;
        return ((unit ^ ((owner >> Gm::SPREAD) & (Gm::UNITS - 1))) << 3) | (e & 7);
    }
}

// N minima of consecutive edges from `start` (N a power of two; aligned runs never straddle a unit) out of
// a shared cost buffer, one unit (or less) at a time
template <int K, int N>
TE_FN void load_costs(half (&dst)[N], const half* costs, int start)
{
    constexpr int PIECE = N < 8 ? N : 8;
    #pragma unroll
    for (int i = 0; i < N / PIECE; ++i)
    {
        alignas(16) half piece[PIECE];
        load_halves<PIECE>(piece, costs + cost_slot<K>(start + PIECE * i));
        #pragma unroll
        for (int j = 0; j < PIECE; ++j) dst[PIECE * i + j] = piece[j];
    }
}

// Thread t's P pairs of minima into a shared cost buffer, one unit (or less) at a time
template <int K, int P>
TE_FN void store_costs(half* costs, int e0, const half2 (&src)[P])
{
    constexpr int PIECE = P < 4 ? P : 4;  // pairs per store
    #pragma unroll
    for (int i = 0; i < P / PIECE; ++i)
    {
        alignas(16) half2 piece[PIECE];
        #pragma unroll
        for (int j = 0; j < PIECE; ++j) piece[j] = src[PIECE * i + j];
        store_pairs<PIECE>(costs + cost_slot<K>(e0 + 2 * PIECE * i), piece);
    }
}

TE_FN uint32_t rev5(uint32_t x)
{
#ifdef TRELLIS_HOST
    uint32_t r = 0;
    for (int b = 0; b < 5; ++b) r |= ((x >> b) & 1u) << (4 - b);
    return r;
#else
    return __brev(x) >> 27;
#endif
}

// The tie order over equal final costs: an edge's rank (unique, 16 bits), and back
TE_FN uint32_t edge_rank(uint32_t e)
{
    const uint32_t low = e & 1023u;
    return (rev5(low >> 5) << 10) | (rev5(low & 31u) << 5) | (e >> 10);
}
TE_FN uint32_t rank_edge(uint32_t r)
{
    return ((r & 31u) << 10) | (rev5(r >> 10) << 5) | rev5((r >> 5) & 31u);
}

// Thread t's decoded values: dec[k][j] holds the states (k << (16-K)) | e for its edge pair j
template <int K, int CB>
TE_FN void decode_thread(int t, half2 (&dec)[Geometry<K>::Q][Geometry<K>::P])
{
    using Gm = Geometry<K>;
    const int e0 = t * Gm::E;
    #pragma unroll
    for (int k = 0; k < Gm::Q; ++k)
    {
        #pragma unroll
        for (int j = 0; j < Gm::P; ++j)
        {
            const uint32_t s = ((uint32_t) k << (16 - K)) | (uint32_t) (e0 + 2 * j);
            dec[k][j] = __halves2half2(decode_state<CB>(s), decode_state<CB>(s + 1));
        }
    }
}

// One forward step for thread t: the minimum over the 2^K predecessors of every edge it owns, into `next`
// (and `hrow` when not null). prev null: the first step, a plain square, and only from edge `pre` if >= 0
template <int K>
TE_FN void forward_thread(int t, const half2 (&dec)[Geometry<K>::Q][Geometry<K>::P], half w, const half* prev,
                          half* next, half* hrow, int pre)
{
    using Gm = Geometry<K>;
    const int e0 = t * Gm::E;
    const half2 w2 = __half2half2(w);
    alignas(16) half2 m[Gm::P];  // aligned for the vector stores of store_costs
    #pragma unroll
    for (int k = 0; k < Gm::Q; ++k)
    {
        alignas(16) half c[Gm::G];  // aligned for the vector loads of load_costs
        if (prev) load_costs<K, Gm::G>(c, prev, (k << Gm::KSHIFT) | (e0 >> K));
        #pragma unroll
        for (int j = 0; j < Gm::P; ++j)
        {
            const half2 d = __hsub2(dec[k][j], w2);
            half2 v;
            if (prev)
            {
                v = __hfma2(d, d, __half2half2(c[(2 * j) >> K]));
            }
            else
            {
                v = __hmul2(d, d);
                if (pre >= 0 && ((k << Gm::KSHIFT) | ((e0 + 2 * j) >> K)) != pre) v = __half2half2(inf_half());
            }
            m[j] = k == 0 ? v : __hmin2(m[j], v);
        }
    }
    store_costs<K, Gm::P>(next, e0, m);
    if (hrow) store_pairs<Gm::P>(hrow + e0, m);
}

// Thread t's smallest (cost bits << 16 | rank) over its edges of the final step
template <int K>
TE_FN uint32_t final_key_thread(int t, const half* costs)
{
    using Gm = Geometry<K>;
    const int e0 = t * Gm::E;
    uint32_t best = NO_KEY;
    #pragma unroll
    for (int j = 0; j < Gm::E; ++j)
    {
        const uint32_t e = (uint32_t) (e0 + j);
        const uint32_t key = ((uint32_t) __half_as_ushort(costs[cost_slot<K>((int) e)]) << 16) | edge_rank(e);
        best = key < best ? key : best;
    }
    return best;
}

// The final edge from the block's smallest key; every cost infinite: edge 0, as exllamav3 does
TE_FN int final_edge(uint32_t best) { return best >= 0x7c000000u ? 0 : (int) rank_edge(best & 0xffffu); }

// The history row that keeps step i's minima, or -1 for a step it skips (STRIDE 2: the even ones)
template <int K>
TE_FN int history_row(int i) { return Geometry<K>::STRIDE == 1 ? i : ((i & 1) ? (i >> 1) : -1); }

// The minimum cost of edge x after step r as the forward pass computed it: from the history, or for a step
// the history skips, recomputed over x's 2^K predecessors from step r - 1's row (a plain square at step 0)
template <int K, int CB>
TE_FN half step_cost(uint32_t x, int r, half w_r, int pre, const half* hist)
{
    using Gm = Geometry<K>;
    if (history_row<K>(r) >= 0) return hist[(size_t) history_row<K>(r) * Gm::EDGES + x];
    half m = inf_half();
    #pragma unroll
    for (int k = 0; k < Gm::Q; ++k)
    {
        const uint32_t s = ((uint32_t) k << (16 - K)) | x;
        const half d = __hsub(decode_state<CB>(s), w_r);
        half v;
        if (r == 0)
        {
            v = __hmul(d, d);
            if (pre >= 0 && (int) (s >> K) != pre) v = inf_half();
        }
        else
        {
            v = __hfma(d, d, hist[(size_t) history_row<K>(r - 1) * Gm::EDGES + (s >> K)]);
        }
        m = k == 0 ? v : __hmin(m, v);
    }
    return m;
}

// Traceback, candidate k of edge e at position index i: (cost bits << 16 | k), recomputed with the forward
// pass's operations from step i - 1's minima (`w_prev`: that step's weight; unused at i = 0)
template <int K, int CB>
TE_FN uint32_t candidate_key(int k, uint32_t e, half w, int i, int pre, const half* hist, half w_prev)
{
    const uint32_t s = ((uint32_t) k << (16 - K)) | e;
    const uint32_t in = s >> K;
    const half d = __hsub(decode_state<CB>(s), w);
    half v;
    if (i == 0)
    {
        v = __hmul(d, d);
        if (pre >= 0 && (int) in != pre) v = inf_half();
    }
    else
    {
        v = __hfma(d, d, step_cost<K, CB>(in, i - 1, w_prev, pre, hist));
    }
    return ((uint32_t) __half_as_ushort(v) << 16) | (uint32_t) k;
}

TE_FN uint32_t state_of(uint32_t best, uint32_t e, int K) { return ((best & 0xffffu) << (16 - K)) | e; }

TE_FN int ring(int i, int roll) { return i + roll >= L ? i + roll - L : i + roll; }

// Which steps' minima the traceback reads: pass 1 (roll L/2) traces back to ring position 0, index L/2,
// and reads steps L/2 - 1 .. L - 2; pass 2 reads steps 0 .. L - 2. The history keeps those of them that
// history_row gives a row (L/2 - 1 is odd, so pass 1's first read step is kept at either stride)
template <int K>
TE_FN half* kept_row(half* hist, int i, int keep_from)
{
    return i >= keep_from && i <= L - 2 && history_row<K>(i) >= 0
        ? hist + (size_t) history_row<K>(i) * Geometry<K>::EDGES : nullptr;
}

#ifndef TRELLIS_HOST

template <int K, int CB>
__global__ void __launch_bounds__(NT, 1)
trellis_encode_kernel(const float* __restrict__ tiles, float* __restrict__ out_values,
                      int16_t* __restrict__ out_states, half* __restrict__ history, int num_tiles)
{
    using Gm = Geometry<K>;
    extern __shared__ __align__(16) uint8_t smem[];
    half* costs0 = reinterpret_cast<half*>(smem);
    half* costs1 = costs0 + Gm::EDGES;
    half* sh_w = costs1 + Gm::EDGES;                            // the tile in fp16
    uint32_t* sh_red = reinterpret_cast<uint32_t*>(sh_w + L);   // one word per warp
    volatile int* sh_edge = reinterpret_cast<volatile int*>(sh_red + NT / 32);

    const int t = threadIdx.x;
    const int lane = t & 31;
    half* hist = history + (size_t) blockIdx.x * Gm::ROWS * Gm::EDGES;

    // Decoded values of this thread's states, kept for every step of every tile
    half2 dec[Gm::Q][Gm::P];
    decode_thread<K, CB>(t, dec);

    // Forward pass over all L steps (ring rolled by `roll`), from edge `pre` if >= 0; the last step's
    // minima end in costs1 (L is even)
    auto forward = [&](int roll, int pre, int keep_from)
    {
        for (int i = 0; i < L; ++i)
        {
            half* next = (i & 1) ? costs1 : costs0;
            const half* prev = i == 0 ? nullptr : ((i & 1) ? costs0 : costs1);
            forward_thread<K>(t, dec, sh_w[ring(i, roll)], prev, next, kept_row<K>(hist, i, keep_from), pre);
            __syncthreads();
        }
    };

    // Traceback by warp 0 from edge `e` at the last step (lane = candidate). Pass 1 (states null) stops at
    // ring position 0 and returns the edge before it; pass 2 writes states and values for every position
    auto traceback = [&](int roll, int pre, int e, float* vals, int16_t* states)
    {
        for (int i = L - 1; i >= 0; --i)
        {
            const int ri = ring(i, roll);
            const half w = sh_w[ri];
            const half w_prev = sh_w[ring(i > 0 ? i - 1 : 0, roll)];
            uint32_t best = NO_KEY;
            #pragma unroll
            for (int r = 0; r < (Gm::Q + 31) / 32; ++r)
            {
                const int k = lane + 32 * r;
                if (k < Gm::Q) best = min(best, candidate_key<K, CB>(k, (uint32_t) e, w, i, pre, hist, w_prev));
            }
            best = __reduce_min_sync(0xffffffffu, best);
            const uint32_t s = state_of(best, (uint32_t) e, K);
            if (states && lane == 0)
            {
                states[ri] = (int16_t) (uint16_t) s;
                vals[ri] = __half2float(decode_state<CB>(s));
            }
            e = (int) (s >> K);
            if (!states && ri == 0) break;
        }
        return e;
    };

    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x)
    {
        const float* in = tiles + (size_t) tile * L;
        for (int i = t; i < L; i += NT) sh_w[i] = __float2half_rn(in[i]);
        __syncthreads();

        // Pass 1: from the ring's middle, unconstrained; then the final edge of least cost
        forward(L / 2, -1, L / 2 - 1);
        uint32_t best = __reduce_min_sync(0xffffffffu, final_key_thread<K>(t, costs1));
        if (lane == 0) sh_red[t >> 5] = best;
        __syncthreads();
        if (t < 32)
        {
            best = __reduce_min_sync(0xffffffffu, lane < NT / 32 ? sh_red[lane] : NO_KEY);
            const int boundary = traceback(L / 2, -1, final_edge(best), nullptr, nullptr);
            if (lane == 0) *sh_edge = boundary;
        }
        __syncthreads();
        const int boundary = *sh_edge;

        // Pass 2: from position 0, starting and ending in the boundary edge
        forward(0, boundary, 0);
        if (t < 32) traceback(0, boundary, boundary, out_values + (size_t) tile * L, out_states + (size_t) tile * L);
        __syncthreads();
    }
}

#endif  // !TRELLIS_HOST
}  // namespace trellis

#ifndef TRELLIS_HOST
namespace {

using namespace trellis;

template <int K, int CB>
void launch(const torch::Tensor& tiles, torch::Tensor& values, torch::Tensor& states, int64_t max_blocks)
{
    constexpr int EDGES = Geometry<K>::EDGES;
    constexpr int ROWS = Geometry<K>::ROWS;  // a plain constant: a dependent one would make `history` a dependent type
    const int num_tiles = (int) tiles.size(0);
    if (num_tiles == 0) return;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    int blocks = std::min(num_tiles, sms);
    if (max_blocks > 0) blocks = (int) std::min<int64_t>(blocks, max_blocks);
    auto history = torch::empty({(int64_t) blocks * ROWS * EDGES}, tiles.options().dtype(torch::kHalf));
    const size_t shmem = (2 * EDGES + L) * sizeof(half) + (NT / 32 + 4) * sizeof(uint32_t);
    auto kernel = trellis_encode_kernel<K, CB>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shmem));
    kernel<<<blocks, NT, shmem, at::cuda::getCurrentCUDAStream()>>>(
        tiles.data_ptr<float>(), values.data_ptr<float>(), states.data_ptr<int16_t>(),
        reinterpret_cast<half*>(history.data_ptr<at::Half>()), num_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int K>
void launch_cb(int64_t cb, const torch::Tensor& tiles, torch::Tensor& values, torch::Tensor& states, int64_t mb)
{
    switch (cb)
    {
        case 0: launch<K, 0>(tiles, values, states, mb); break;
        case 1: launch<K, 1>(tiles, values, states, mb); break;
        case 2: launch<K, 2>(tiles, values, states, mb); break;
        default: TORCH_CHECK(false, "trellis_encode: codebook must be 0 (3INST), 1 (mcg) or 2 (mul1), got ", cb);
    }
}

}  // namespace

// tiles: (N, 256) float32, contiguous, on a CUDA device. Returns (values float32 (N, 256), states int16 (N, 256)).
std::vector<torch::Tensor> encode_tiles(torch::Tensor tiles, int64_t K, int64_t cb, int64_t max_blocks)
{
    TORCH_CHECK(tiles.is_cuda() && tiles.scalar_type() == torch::kFloat && tiles.dim() == 2 && tiles.size(1) == L
                && tiles.is_contiguous(), "trellis_encode: tiles must be a contiguous CUDA float32 (N, 256) tensor");
    const c10::cuda::CUDAGuard guard(tiles.device());
    auto values = torch::empty_like(tiles);
    auto states = torch::empty(tiles.sizes(), tiles.options().dtype(torch::kShort));
    switch (K)
    {
        case 1: launch_cb<1>(cb, tiles, values, states, max_blocks); break;
        case 2: launch_cb<2>(cb, tiles, values, states, max_blocks); break;
        case 3: launch_cb<3>(cb, tiles, values, states, max_blocks); break;
        case 4: launch_cb<4>(cb, tiles, values, states, max_blocks); break;
        case 5: launch_cb<5>(cb, tiles, values, states, max_blocks); break;
        case 6: launch_cb<6>(cb, tiles, values, states, max_blocks); break;
        default: TORCH_CHECK(false, "trellis_encode: K must be 1..6, got ", K);
    }
    return {values, states};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("encode_tiles", &encode_tiles, "Viterbi encode of 16x16 EXL3 tiles (docs/encoder.md)");
}
#endif  // !TRELLIS_HOST

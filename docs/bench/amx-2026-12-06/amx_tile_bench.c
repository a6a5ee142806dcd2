/* What one group of a tile GEMM costs on AMX-INT8 (2026-12-06, README.md here): time-stamp-counter cycles per group for
 * R rows of A (K = 64 bytes) against one 16-output weight tile. `serial`: load the weights and rows, zero, one
 * TDPBSSD, store the int32 sums (what a group-scaled GEMM must do: every group has its own fp32 scales, so each
 * group's sums leave the tiles); `alt`: the same on two sets of tiles, alternating; `dp-chain` / `dp-indep`: the
 * products alone; `load+dp`: without the store.
 *
 *     gcc -O2 -march=native amx_tile_bench.c -o amx_tile_bench && ./amx_tile_bench
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <x86intrin.h>
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static int8_t A[16 * 64 * 64] __attribute__((aligned(64)));
static int8_t B[64][16 * 64] __attribute__((aligned(64)));
static int32_t C[64][2][16 * 16] __attribute__((aligned(64)));
int main(int argc, char **argv) {
    syscall(SYS_arch_prctl, 0x1023, 18);
    for (int R = 1; R <= 16; R *= 2) {
        cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
        for (int t = 0; t < 8; t++) { c.rows[t] = R; c.colsb[t] = 64; }
        c.rows[4] = 16; c.rows[7] = 16;
        _tile_loadconfig(&c);
        long N = 200000;
        /* variant 1: serial same tiles: load A, load B, zero, dp, store */
        uint64_t t0 = __rdtsc();
        for (long i = 0; i < N; i++) {
            int j = i & 63;
            _tile_loadd(4, B[j], 64); _tile_loadd(2, A + j * 64, 64 * 64);
            _tile_zero(0); _tile_dpbssd(0, 2, 4); _tile_stored(0, C[j][0], 64);
        }
        uint64_t t1 = __rdtsc();
        /* variant 2: alternate C tiles 0 / 1 and A 2 / 3, B 4 / 7 */
        for (long i = 0; i < N; i += 2) {
            int j = i & 63;
            _tile_loadd(4, B[j], 64); _tile_loadd(2, A + j * 64, 64 * 64);
            _tile_zero(0); _tile_dpbssd(0, 2, 4); _tile_stored(0, C[j][0], 64);
            _tile_loadd(7, B[j + 1], 64); _tile_loadd(3, A + (j + 1) * 64, 64 * 64);
            _tile_zero(1); _tile_dpbssd(1, 3, 7); _tile_stored(1, C[j + 1][0], 64);
        }
        uint64_t t2 = __rdtsc();
        /* variant 3: dp only (accumulate, no loads/stores) */
        for (long i = 0; i < N; i++) { _tile_dpbssd(0, 2, 4); }
        uint64_t t3 = __rdtsc();
        /* variant 4: dp into 4 independent C tiles */
        for (long i = 0; i < N; i += 4) { _tile_dpbssd(0, 2, 4); _tile_dpbssd(1, 2, 4); _tile_dpbssd(5, 2, 4); _tile_dpbssd(6, 2, 4);}
        uint64_t t4 = __rdtsc();
        /* variant 5: loads + dp no store, independent */
        for (long i = 0; i < N; i++) { int j = i & 63; _tile_loadd(4, B[j], 64); _tile_loadd(2, A + j * 64, 64 * 64); _tile_dpbssd(0, 2, 4);}
        uint64_t t5 = __rdtsc();
        printf("R=%2d serial %.1f  alt %.1f  dp-chain %.1f  dp-indep %.1f  load+dp %.1f cycles/group\n", R,
               (double)(t1 - t0) / N, (double)(t2 - t1) / N, (double)(t3 - t2) / N, (double)(t4 - t3) / N, (double)(t5 - t4) / N);
        _tile_release();
    }
}

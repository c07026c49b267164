/* CRC32C (Castagnoli) for the fs tier's block files: the SSE4.2 instruction where the CPU has
 * it (checked once at run time), else a slicing-by-8 table. Same value as google-crc32c's
 * `value()` and the `crc32c` package (initial ~0, final xor ~0): crc32c("123456789") is
 * 0xE3069283. Included by _fsio.c only. */
#ifndef KV_FSIO_CRC_H
#define KV_FSIO_CRC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KV_CRC32C_POLY 0x82F63B78u /* reflected */

static uint32_t kv_crc_table[8][256];
static int kv_crc_hw = -1; /* -1: not initialised; 0: table; 1: SSE4.2 */

static void kv_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (KV_CRC32C_POLY & (0u - (c & 1u)));
        kv_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            kv_crc_table[t][i] = (kv_crc_table[t - 1][i] >> 8) ^ kv_crc_table[0][kv_crc_table[t - 1][i] & 0xFF];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    kv_crc_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    kv_crc_hw = 0;
#endif
}

/* (state is the running register, already inverted) */
static uint32_t kv_crc_sw(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ kv_crc_table[0][(c ^ *p++) & 0xFF];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        uint32_t lo = (uint32_t)w ^ c, hi = (uint32_t)(w >> 32);
        c = kv_crc_table[7][lo & 0xFF] ^ kv_crc_table[6][(lo >> 8) & 0xFF] ^ kv_crc_table[5][(lo >> 16) & 0xFF] ^
            kv_crc_table[4][lo >> 24] ^ kv_crc_table[3][hi & 0xFF] ^ kv_crc_table[2][(hi >> 8) & 0xFF] ^
            kv_crc_table[1][(hi >> 16) & 0xFF] ^ kv_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ kv_crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* One dependent chain of 8-byte steps: about 8 bytes per 3 cycles (several GB/s on one core),
 * far above what a disk feeds one block's reader. */
__attribute__((target("sse4.2"))) static uint32_t kv_crc_hw_run(uint32_t c, const unsigned char *p, size_t n) {
    uint64_t c64 = c;
    while (n && ((uintptr_t)p & 7)) {
        c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
        n--;
    }
    while (n >= 32) {
        uint64_t a, b, d, e;
        memcpy(&a, p, 8);
        memcpy(&b, p + 8, 8);
        memcpy(&d, p + 16, 8);
        memcpy(&e, p + 24, 8);
        c64 = __builtin_ia32_crc32di(c64, a);
        c64 = __builtin_ia32_crc32di(c64, b);
        c64 = __builtin_ia32_crc32di(c64, d);
        c64 = __builtin_ia32_crc32di(c64, e);
        p += 32;
        n -= 32;
    }
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c64 = __builtin_ia32_crc32di(c64, a);
        p += 8;
        n -= 8;
    }
    while (n--) c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
    return (uint32_t)c64;
}
#endif

/* CRC32C of p[0:n], continuing from `crc` (0 for a fresh checksum). Thread-safe once
 * kv_crc_init() ran (module init). */
static uint32_t kv_crc32c(uint32_t crc, const void *data, size_t n) {
    uint32_t c = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (kv_crc_hw == 1) return ~kv_crc_hw_run(c, (const unsigned char *)data, n);
#endif
    return ~kv_crc_sw(c, (const unsigned char *)data, n);
}

#endif

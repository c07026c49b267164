/* One block file, read or written by one worker thread of _fsio.c (no Python calls here).
 * The format is fs_io.py's (the module docstring there); the two must agree byte for byte:
 *
 *   0     "KVB2" | version u8 | checksum kind u8 | reserved u16 | payload length u64
 *         | payload checksum u32 | key length u32                          (24 bytes, BE)
 *   24    key | header checksum u32 (of everything before it) | zeros to 4096
 *   4096  payload
 */
#ifndef KV_FSIO_BLOCK_H
#define KV_FSIO_BLOCK_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zlib.h>

#include "_fsio_crc.h"

#define HEADER_SIZE 4096
#define ALIGN 4096
#define FIXED 24
#define MAX_KEY (HEADER_SIZE - FIXED - 4)
#define VERSION 2
#define CRC_CRC32C 1
#define CRC_CRC32 2
#ifndef O_DIRECT
#define O_DIRECT 0
#endif

/* statuses: 0 ok, these reasons (fs_io.BlockFileError's), or -errno */
enum { ST_OK, ST_MISSING, ST_SHORT, ST_MAGIC, ST_HEADER, ST_KEY, ST_LENGTH, ST_CHECKSUM, ST_UNVERIFIABLE };

typedef struct {
    const char *path; /* the block's file */
    const char *tmp;  /* (stores) the temp file renamed to path */
    unsigned char *slot;
    const unsigned char *key;
    size_t klen;
    int status;
} kv_item;

/* A worker's buffers: the aligned header page, an aligned bounce buffer (on demand), and the
 * staging area of staged loads (on demand: 2 MiB aligned, in transparent huge pages where the
 * kernel gives them). */
typedef struct {
    unsigned char *head, *bounce, *stage;
    size_t bsize, ssize;
} kv_bufs;

#define HUGE (2u << 20)

/* The staging area for header page + payload of nbytes: one physically contiguous request
 * where the kernel backs it with a huge page, instead of a segment per 4 KiB page of the slot.
 * NULL: out of memory. */
static unsigned char *stage_buffer(kv_bufs *b, size_t nbytes) {
    size_t need = (HEADER_SIZE + nbytes + HUGE - 1) / HUGE * HUGE;
    if (b->stage && b->ssize >= need) return b->stage;
    if (b->stage) munmap(b->stage, b->ssize);
    b->stage = NULL, b->ssize = 0;
    /* over-map by one huge page, then trim to a 2 MiB aligned range of `need` bytes */
    unsigned char *p = (unsigned char *)mmap(NULL, need + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    unsigned char *a = (unsigned char *)(((uintptr_t)p + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    if (a + need < p + need + HUGE) munmap(a + need, (size_t)(p + need + HUGE - (a + need)));
#ifdef MADV_HUGEPAGE
    madvise(a, need, MADV_HUGEPAGE); /* (best effort: without huge pages it still reads, as 4 KiB pages) */
#endif
    b->stage = a, b->ssize = need;
    return a;
}

static void free_bufs(kv_bufs *b) {
    free(b->head);
    free(b->bounce);
    if (b->stage) munmap(b->stage, b->ssize);
}

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint64_t be64(const unsigned char *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

static void put32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16), p[2] = (unsigned char)(v >> 8),
    p[3] = (unsigned char)v;
}

static uint32_t checksum(int kind, const unsigned char *p, size_t n) {
    if (kind == CRC_CRC32C) return kv_crc32c(0, p, n);
    return (uint32_t)crc32_z(0L, p, (z_size_t)n);
}

/* The slot itself, or the bounce buffer where O_DIRECT cannot take the slot as it is (an
 * unaligned address: bounce; a length that is not a page multiple cannot be padded: *direct
 * is cleared and the slot used, buffered) -- as fs_io.py decides. NULL: out of memory. */
static unsigned char *direct_buffer(kv_bufs *b, unsigned char *slot, size_t nbytes, int *direct, int bounce_short) {
    if (!*direct || (nbytes % ALIGN == 0 && (uintptr_t)slot % ALIGN == 0)) return slot;
    if (nbytes % ALIGN) {
        *direct = 0;
        if (!bounce_short) return slot;
    }
    if (!b->bounce || b->bsize < nbytes) {
        void *p = NULL;
        size_t size = nbytes < ALIGN ? ALIGN : nbytes;
        if (posix_memalign(&p, ALIGN, size)) return NULL;
        free(b->bounce);
        b->bounce = (unsigned char *)p;
        b->bsize = size;
    }
    return b->bounce;
}

/* Read and check one block file into it->slot (see _fsio.c's top comment). `staged` (with
 * O_DIRECT and a page-multiple length): header page and payload are read as one request into the
 * worker's staging area and copied into the slot once every check passed. */
static int load_one(const kv_item *it, size_t nbytes, int direct, int staged, kv_bufs *b) {
    /* (a load through the bounce buffer copies into the slot only once every check passed;
     * fs_io reads lengths that are not page multiples through it too) */
    unsigned char *dest, *head = b->head;
    staged = staged && direct && nbytes % ALIGN == 0;
    if (staged) {
        if (!(head = stage_buffer(b, nbytes))) return -ENOMEM;
        dest = head + HEADER_SIZE;
    } else if (!(dest = direct_buffer(b, it->slot, nbytes, &direct, 1))) {
        return -ENOMEM;
    }
    int fd = open(it->path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | (direct ? O_DIRECT : 0));
    if (fd < 0) return errno == ENOENT ? ST_MISSING : -errno;
    /* A file of another size is read as far as its header only: an O_DIRECT read past the end
     * of a file zeroes the rest of the buffer (seen here), which would clobber the slot. */
    struct stat st;
    int whole = fstat(fd, &st) == 0 && (uint64_t)st.st_size == (uint64_t)HEADER_SIZE + nbytes;
    struct iovec iov[2] = {{head, HEADER_SIZE}, {dest, nbytes}};
    int niov = whole ? 2 : 1;
    if (staged && whole) iov[0].iov_len += nbytes, niov = 1; /* header and payload adjoin: one iovec */
    ssize_t got;
    do got = preadv(fd, iov, niov, 0);
    while (got < 0 && errno == EINTR);
    int err = errno;
    close(fd);
    if (got < 0) return -err;
    if (got < HEADER_SIZE) return ST_SHORT;
    if (memcmp(head, "KVB2", 4) != 0) return ST_MAGIC;
    int kind = head[5];
    uint64_t length = be64(head + 8);
    uint32_t crc = be32(head + 16), klen = be32(head + 20);
    if (head[4] != VERSION || klen > MAX_KEY) return ST_HEADER;
    if (kind != CRC_CRC32C && kind != CRC_CRC32) return ST_UNVERIFIABLE;
    if (checksum(kind, head, FIXED + klen) != be32(head + FIXED + klen)) return ST_HEADER;
    if (klen != it->klen || memcmp(head + FIXED, it->key, klen) != 0) return ST_KEY;
    if (length != nbytes) return ST_LENGTH;
    if (!whole || (size_t)got != HEADER_SIZE + nbytes) return ST_SHORT; /* torn, or trailing bytes */
    if (checksum(kind, dest, nbytes) != crc) return ST_CHECKSUM;
    if (dest != it->slot) memcpy(it->slot, dest, nbytes);
    return ST_OK;
}

/* Write it->slot as the block file of it->key: header page + payload in one pwritev to
 * it->tmp (O_EXCL), fdatasync if `sync`, renamed to it->path. 0 or -errno; on error the temp
 * file is gone (as fs_io.write_block_file). */
static int store_one(const kv_item *it, size_t nbytes, int direct, int kind, int sync, kv_bufs *b) {
    unsigned char *head = b->head, *src = direct_buffer(b, it->slot, nbytes, &direct, 0);
    if (!src) return -ENOMEM;
    if (it->klen > MAX_KEY) return -EINVAL;
    if (src != it->slot) memcpy(src, it->slot, nbytes);
    memset(head, 0, HEADER_SIZE);
    memcpy(head, "KVB2", 4);
    head[4] = VERSION;
    head[5] = (unsigned char)kind;
    put32(head + 8, (uint32_t)((uint64_t)nbytes >> 32));
    put32(head + 12, (uint32_t)nbytes);
    put32(head + 16, checksum(kind, src, nbytes));
    put32(head + 20, (uint32_t)it->klen);
    memcpy(head + FIXED, it->key, it->klen);
    put32(head + FIXED + it->klen, checksum(kind, head, FIXED + it->klen));
    int fd = open(it->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0) return -errno;
    struct iovec iov[2] = {{head, HEADER_SIZE}, {src, nbytes}};
    ssize_t n;
    do n = pwritev(fd, iov, 2, 0);
    while (n < 0 && errno == EINTR);
    int err = n < 0 ? errno : (size_t)n != HEADER_SIZE + nbytes ? ENOSPC : 0; /* short: the disk is full */
    if (!err && sync && fdatasync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (!err && rename(it->tmp, it->path) != 0) err = errno;
    if (err) unlink(it->tmp);
    return -err;
}

#endif

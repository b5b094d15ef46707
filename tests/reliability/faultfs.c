/*
 * faultfs: an LD_PRELOAD shim that makes file writes and syncs fail on demand.
 *
 * Built by tests/test_reliability_faults.py (cc -shared -fPIC -o faultfs.so faultfs.c -ldl)
 * and loaded into a child process with LD_PRELOAD. It wraps write, writev, pwrite, pwrite64,
 * pwritev, fsync, fdatasync, ftruncate and ftruncate64. For each call it maps the descriptor
 * to a path (readlink of /proc/self/fd/N) and, if the path contains the configured pattern
 * and the call's class is armed, fails it with the configured errno.
 *
 * Control: the environment variable FAULTFS_CONTROL names a small text file that is re-read
 * on every wrapped call, so the process under test (or its parent) can arm and disarm faults
 * between operations. Lines of `key=value`:
 *
 *   pattern=SUBSTRING   paths to affect; empty or missing disarms everything. A trailing
 *                       `$` anchors it at the end of the path (`/x/store$` is the directory,
 *                       not the files in it).
 *   ops=write,sync,truncate   which classes fail (write = write/writev/pwrite*)
 *   errno=N             errno to fail with (default ENOSPC)
 *   budget=N            bytes that matching writes may still write before they fail; a write
 *                       that crosses the budget is cut short at it (a real full disk does
 *                       that), the next one fails. Default 0. -1 = writes never fail.
 *   count=N             fail at most N calls, then let everything through (default -1 = no limit)
 *   gen=N               bump to reset the byte and failure counters
 *
 * Every injected failure appends one line "OP PATH ERRNO" to FAULTFS_LOG (if set), so a test
 * can prove the fault really fired.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef ssize_t (*writev_fn)(int, const struct iovec *, int);
typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);
typedef ssize_t (*pwrite64_fn)(int, const void *, size_t, off64_t);
typedef ssize_t (*pwritev_fn)(int, const struct iovec *, int, off_t);
typedef int (*sync_fn)(int);
typedef int (*ftruncate_fn)(int, off_t);
typedef int (*ftruncate64_fn)(int, off64_t);

static write_fn real_write;
static writev_fn real_writev;
static pwrite_fn real_pwrite;
static pwrite64_fn real_pwrite64;
static pwritev_fn real_pwritev;
static sync_fn real_fsync;
static sync_fn real_fdatasync;
static ftruncate_fn real_ftruncate;
static ftruncate64_fn real_ftruncate64;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static const char *control_path;
static const char *log_path;
static long long seen_gen = -1;
static long long used_bytes;
static long long failures;

enum { OP_WRITE = 1, OP_SYNC = 2, OP_TRUNCATE = 4 };

struct control {
    char pattern[512];
    int ops;
    int err;
    long long budget;
    long long count;
    long long gen;
};

__attribute__((constructor)) static void faultfs_init(void) {
    real_write = (write_fn)dlsym(RTLD_NEXT, "write");
    real_writev = (writev_fn)dlsym(RTLD_NEXT, "writev");
    real_pwrite = (pwrite_fn)dlsym(RTLD_NEXT, "pwrite");
    real_pwrite64 = (pwrite64_fn)dlsym(RTLD_NEXT, "pwrite64");
    real_pwritev = (pwritev_fn)dlsym(RTLD_NEXT, "pwritev");
    real_fsync = (sync_fn)dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (sync_fn)dlsym(RTLD_NEXT, "fdatasync");
    real_ftruncate = (ftruncate_fn)dlsym(RTLD_NEXT, "ftruncate");
    real_ftruncate64 = (ftruncate64_fn)dlsym(RTLD_NEXT, "ftruncate64");
    control_path = getenv("FAULTFS_CONTROL");
    log_path = getenv("FAULTFS_LOG");
}

/* Read the control file; returns 0 (nothing armed) on any problem. Caller holds `lock`. */
static int load_control(struct control *c) {
    memset(c, 0, sizeof *c);
    c->err = ENOSPC;
    c->count = -1;
    if (control_path == NULL) return 0;
    int fd = open(control_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[2048];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        if (eq == NULL) continue;
        *eq = '\0';
        const char *key = line, *value = eq + 1;
        if (strcmp(key, "pattern") == 0) {
            snprintf(c->pattern, sizeof c->pattern, "%s", value);
        } else if (strcmp(key, "ops") == 0) {
            if (strstr(value, "write")) c->ops |= OP_WRITE;
            if (strstr(value, "sync")) c->ops |= OP_SYNC;
            if (strstr(value, "truncate")) c->ops |= OP_TRUNCATE;
        } else if (strcmp(key, "errno") == 0) {
            c->err = atoi(value);
        } else if (strcmp(key, "budget") == 0) {
            c->budget = atoll(value);
        } else if (strcmp(key, "count") == 0) {
            c->count = atoll(value);
        } else if (strcmp(key, "gen") == 0) {
            c->gen = atoll(value);
        }
    }
    if (c->gen != seen_gen) {
        seen_gen = c->gen;
        used_bytes = 0;
        failures = 0;
    }
    return c->pattern[0] != '\0' && c->ops != 0;
}

static int fd_matches(int fd, const char *pattern, char *path, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, size - 1);
    if (n < 0) return 0;
    path[n] = '\0';
    size_t plen = strlen(pattern);
    if (plen > 0 && pattern[plen - 1] == '$') {
        size_t len = (size_t)n;
        return len >= plen - 1 && strncmp(path + len - (plen - 1), pattern, plen - 1) == 0;
    }
    return strstr(path, pattern) != NULL;
}

static void note(const char *op, const char *path, int err) {
    if (log_path == NULL) return;
    int fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    char line[PATH_MAX + 64];
    int len = snprintf(line, sizeof line, "%s %s %d\n", op, path, err);
    if (len > 0) real_write(fd, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
    close(fd);
}

/*
 * Decide a call's fate. For writes, `*allowed` gets how many of `want` bytes may go through
 * (want = all of them, less = a short write at the budget); returns the errno to fail with,
 * or 0 to let the call (or its allowed prefix) proceed.
 */
static int decide(int fd, int op, const char *name, size_t want, size_t *allowed) {
    if (allowed) *allowed = want;
    if (control_path == NULL) return 0;
    pthread_mutex_lock(&lock);
    struct control c;
    char path[PATH_MAX];
    int err = 0;
    if (load_control(&c) && (c.ops & op) && (c.count < 0 || failures < c.count) &&
        fd_matches(fd, c.pattern, path, sizeof path)) {
        if (op == OP_WRITE && c.budget < 0) {
            err = 0;
        } else if (op == OP_WRITE && used_bytes < c.budget) {
            long long left = c.budget - used_bytes;
            if ((long long)want > left) *allowed = (size_t)left;
            used_bytes += (long long)*allowed;
        } else {
            err = c.err;
            failures++;
            note(name, path, err);
        }
    }
    pthread_mutex_unlock(&lock);
    return err;
}

static size_t iov_total(const struct iovec *iov, int iovcnt) {
    size_t total = 0;
    for (int i = 0; i < iovcnt; i++) total += iov[i].iov_len;
    return total;
}

/* Copy `iov` into `out`, cut to `limit` bytes; returns the new count. */
static int iov_cut(const struct iovec *iov, int iovcnt, size_t limit, struct iovec *out) {
    int n = 0;
    for (int i = 0; i < iovcnt && limit > 0; i++) {
        out[n] = iov[i];
        if (out[n].iov_len > limit) out[n].iov_len = limit;
        limit -= out[n].iov_len;
        n++;
    }
    return n;
}

ssize_t write(int fd, const void *buf, size_t count) {
    size_t allowed;
    int err = decide(fd, OP_WRITE, "write", count, &allowed);
    if (err) {
        errno = err;
        return -1;
    }
    return real_write(fd, buf, allowed);
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    size_t allowed;
    int err = decide(fd, OP_WRITE, "pwrite", count, &allowed);
    if (err) {
        errno = err;
        return -1;
    }
    return real_pwrite(fd, buf, allowed, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off64_t offset) {
    size_t allowed;
    int err = decide(fd, OP_WRITE, "pwrite64", count, &allowed);
    if (err) {
        errno = err;
        return -1;
    }
    return real_pwrite64(fd, buf, allowed, offset);
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    size_t total = iov_total(iov, iovcnt), allowed;
    int err = decide(fd, OP_WRITE, "writev", total, &allowed);
    if (err) {
        errno = err;
        return -1;
    }
    if (allowed == total || iovcnt > 64) return real_writev(fd, iov, iovcnt);
    struct iovec cut[64];
    return real_writev(fd, cut, iov_cut(iov, iovcnt, allowed, cut));
}

ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, off_t offset) {
    size_t total = iov_total(iov, iovcnt), allowed;
    int err = decide(fd, OP_WRITE, "pwritev", total, &allowed);
    if (err) {
        errno = err;
        return -1;
    }
    if (allowed == total || iovcnt > 64) return real_pwritev(fd, iov, iovcnt, offset);
    struct iovec cut[64];
    return real_pwritev(fd, cut, iov_cut(iov, iovcnt, allowed, cut), offset);
}

int fsync(int fd) {
    int err = decide(fd, OP_SYNC, "fsync", 0, NULL);
    if (err) {
        errno = err;
        return -1;
    }
    return real_fsync(fd);
}

int fdatasync(int fd) {
    int err = decide(fd, OP_SYNC, "fdatasync", 0, NULL);
    if (err) {
        errno = err;
        return -1;
    }
    return real_fdatasync(fd);
}

int ftruncate(int fd, off_t length) {
    int err = decide(fd, OP_TRUNCATE, "ftruncate", 0, NULL);
    if (err) {
        errno = err;
        return -1;
    }
    return real_ftruncate(fd, length);
}

int ftruncate64(int fd, off64_t length) {
    int err = decide(fd, OP_TRUNCATE, "ftruncate64", 0, NULL);
    if (err) {
        errno = err;
        return -1;
    }
    return real_ftruncate64(fd, length);
}

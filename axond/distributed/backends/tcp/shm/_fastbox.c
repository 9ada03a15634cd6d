/* The prepared mailbox ops (mailbox_ops.Prepared) in C: post, a short wait, the call check and the copies or the
 * reduction of one small op in one call, where the Python path runs about ten.
 *
 * It speaks exactly the protocol of mailbox.py (one slot per rank and buffer: the sequence word, the 9 header
 * fields, the payload; payload and header first, then the sequence word), so ranks with and without it share a
 * mailbox. It does only the common case: every member posted within the wait's turns and posted the same call. In
 * any other case it returns the buffer it posted in, and the Python side waits as mailbox.Mailbox.settle does
 * (clocks, sockets, timeouts, errors naming the peer) and then calls `finish`. Reductions are in rank order, as
 * NumPy's ufuncs in mailbox_ops: out = row0 op row1, then out op row2, ...; integer sums and products wrap;
 * minimum and maximum propagate NaN as np.minimum and np.maximum do; AVG divides the float sum by the group size.
 *
 * It also runs the single-copy ops of single_copy_ops (broadcast and all_gather) through the same mailbox, in their
 * protocol: a post of the call with this rank's (pid, address, bytes, -1, 0, 0), the reads of the peers' buffers with
 * process_vm_readv, a second post of the call without payload (every member finished reading).
 * Built as an optional extension: without it (no compiler) the Python path runs alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HEAD_OFF 8        /* the header fields follow the sequence word */
#define HEAD_BYTES 72     /* mailbox.HEAD: 9 int64 fields */
#define CALL_BYTES 64     /* its first 8 fields: the call, without the payload size */
#define SEQ_OFF (HEAD_OFF + 4 * 8)   /* mailbox.SEQ_FIELD */
#define PROGRESS_OFF 80   /* word 10 of a slot, which the Python path leaves alone: a broadcast root's progress */
#define WAITERS_OFF 88    /* word 11 of a slot (its low half): ranks blocked on the slot's sequence word (futex) */
#define PAYLOAD_OFF 128   /* mailbox.HEAD_WORDS * 8 */
#define CHUNK (16 << 10)  /* a broadcast root publishes its payload in chunks of this size */
#define MAX_SIZE 64       /* the most members the compiled ops serve; larger groups keep the Python path */
#define POSTED_OFF (HEAD_OFF + 8 * 8)  /* the header's last field: the payload's size */
#define SC_WORDS 6        /* single_copy.WORDS: pid, address, bytes, memfd, token, offset */
#define SC_POSTED (SC_WORDS * 8)
#define PAGE 4096
#define SLOW_DISTANCE 32  /* distributed/policy.py HOST_COPY_SLOW_DISTANCE: a string copy to 1..31 bytes after its source (mod PAGE) */
#define BOUNCE_BYTES (1 << 20)  /* tcp/policy.py BOUNCE_BYTES */
#define BOUNCE_MIN (64 << 10)   /* tcp/policy.py BOUNCE_MIN_BYTES */

enum { K_ALL_REDUCE, K_BCAST_ROOT, K_BCAST_LEAF, K_ALL_GATHER, K_REDUCE_SCATTER, K_BARRIER, K_SC_BCAST,
       K_SC_ALL_GATHER, K_KINDS };
enum { R_SUM, R_PRODUCT, R_MIN, R_MAX, R_OPS };
enum { D_NONE, D_F32, D_F64, D_I32, D_I64 };

/* ---------------------------------------------------------------- Box: the mapping and the op counter */

typedef struct {
    PyObject_HEAD
    Py_buffer map;
    int open;
    long long ops;  /* mailbox ops run so far in this group (Mailbox.ops) */
    int turns;      /* sched_yield turns a wait takes after its polling, before it blocks */
    long long poll_ns;   /* how long a wait polls the words (no system call) before it yields */
    long long block_ns;  /* how long an op's wait blocks (futex) before it returns to the Python wait */
    long long yield_cost;  /* what a yield of the waits took lately (ns, an average over waits of their yields' mean) */
    long long yield_limit; /* the waits stop yielding (they block at once) while yield_cost is above this */
    long long probe_ops;   /* at most this many ops between two waits that yield although the waits block */
    long long probe_every; /* ops between two such tries now: doubling while they cost too much, halving when not */
    long long next_probe;  /* the op whose first wait tries yielding again */
    int yielding;          /* whether the waits yield (where they may: `turns`): yield_cost <= yield_limit */
    long long blocks;    /* futex waits so far (Box.blocks) */
    long long probes;    /* waits that tried the way that cost more (Box.probes) */
    Py_ssize_t slot;     /* bytes per slot (0: no presence table) */
    int size, rank;      /* the group's size and this rank (the presence table's rows) */
    Py_ssize_t table;    /* byte offset of the presence table: per rank, the core it was last seen on */
    uint32_t activity;   /* this rank's posts and waits so far, as its presence word counts them */
    int busy;       /* ops inside `run` (one may wait without the GIL): `close` lets them finish first */
    int home;       /* this rank's core where the group's ranks outnumber their cores (Mailbox.home), else -1 */
    unsigned ticks; /* ops since the last look at the core this rank runs on */
    long long moves;  /* times an op found this rank off its home core and moved it back */
    long long next_move;  /* the op from which move_off may move this rank again */
    long long probe_first; /* the fewest ops between two waits that yield although the waits block (policy) */
    unsigned home_every;   /* ops between two looks at the core this rank runs on (policy) */
    long long move_every;  /* the fewest ops between two moves off a shared core (policy) */
} Box;

static int Box_init(Box *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"mapping", "turns", "poll_ns", "block_ns", "yield_limit_ns", "probe_ops", "slot", "size",
                            "rank", "probe_first", "home_every", "move_every", NULL};
    PyObject *mapping;
    int turns, size = 0, rank = -1;
    long long poll_ns = 0, block_ns = 0, yield_limit_ns = 200000, probe_ops = 1024;
    long long probe_first = 16, home_every = 64, move_every = 16;  /* tcp/policy.py passes its own (MAILBOX_*) */
    Py_ssize_t slot = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|LLLLniiLLL", names, &mapping, &turns, &poll_ns, &block_ns,
                                     &yield_limit_ns, &probe_ops, &slot, &size, &rank, &probe_first, &home_every,
                                     &move_every))
        return -1;
    if (probe_first < 1 || home_every < 1 || home_every > 1 << 30 || move_every < 1) {
        PyErr_SetString(PyExc_ValueError, "probe_first, home_every and move_every must be at least 1");
        return -1;
    }
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Box is initialised already");
        return -1;
    }
    if (turns < 0 || poll_ns < 0 || block_ns < 0 || yield_limit_ns < 0 || probe_ops < 1) {
        PyErr_SetString(PyExc_ValueError, "turns and times must not be negative");
        return -1;
    }
    self->poll_ns = poll_ns;
    self->block_ns = block_ns;
    self->yield_cost = 0;  /* yield first: where nothing else wants the cores it is the cheap way */
    self->yield_limit = yield_limit_ns;
    self->probe_ops = probe_ops;
    self->probe_first = probe_first;
    self->home_every = (unsigned)home_every;
    self->move_every = move_every;
    self->probe_every = probe_ops < probe_first ? probe_ops : probe_first;
    self->next_probe = self->probe_every;
    self->yielding = 1;
    if (PyObject_GetBuffer(mapping, &self->map, PyBUF_WRITABLE) < 0)
        return -1;
    if (((uintptr_t)self->map.buf) % 8) {
        PyBuffer_Release(&self->map);
        PyErr_SetString(PyExc_ValueError, "the mapping must be 8-byte aligned");
        return -1;
    }
    /* the presence table: in the spare slot (number `size`) of buffer 0, one word per rank */
    if (slot != 0 && (slot < 0 || slot % 8 || size < 2 || size > MAX_SIZE || rank < 0 || rank >= size ||
                      slot < 8 * size || 2 * (size + 1) * slot > self->map.len)) {
        PyBuffer_Release(&self->map);
        PyErr_SetString(PyExc_ValueError, "slot, size and rank do not fit the mapping");
        return -1;
    }
    self->slot = slot;
    self->size = size;
    self->rank = rank;
    self->table = slot ? (Py_ssize_t)size * slot : -1;
    self->open = 1;
    self->turns = turns;
    self->home = -1;
    return 0;
}

/* Where the ranks have a core each, two found on one core stay there once their waits block (a woken rank is put
 * beside its waker): move this rank off core `cpu` (any other core its mask allows, the kernel's choice), at most
 * once every `move_every` ops. */
static void move_off(Box *box, int cpu) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || box->ops < box->next_move)
        return;
    box->next_move = box->ops + box->move_every;
    cpu_set_t allowed, others;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        return;
    others = allowed;
    CPU_CLR(cpu, &others);
    if (CPU_COUNT(&others) == 0 || sched_setaffinity(0, sizeof others, &others) != 0)
        return;
    sched_setaffinity(0, sizeof allowed, &allowed);
    box->moves++;
}

/* Every `home_every` ops, move this rank back to its home core if the kernel moved it: its balancer moves a spinning
 * rank off a core another process used for a while, and a rank that slept wakes wherever the kernel puts it. As
 * spread.move_to: narrow the mask to the core (the kernel migrates the thread now), then set it back. */
static int go_home(Box *box) {
    if (box->home < 0 || box->home >= CPU_SETSIZE || sched_getcpu() == box->home)
        return 0;
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(box->home, &allowed))
        return 0;
    CPU_ZERO(&one);
    CPU_SET(box->home, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0)
        return 0;
    sched_setaffinity(0, sizeof allowed, &allowed);
    box->moves++;
    return 1;
}

/* Also while the waits block instead of yielding (a busy loop beside the ranks): the kernel wakes a blocked rank beside
 * its waker, and four ranks on 2 cores end up on one core while the busy loop has the other to itself (their 1 MiB
 * ops at twice the time of ranks kept two per core; docs/design/mailbox.md#ranks-on-one-core). */
static void keep_home(Box *box) {
    if (box->home >= 0 && ++box->ticks % box->home_every == 0)
        go_home(box);
}

/* ---------------------------------------------------------------- waiting for the members' posts */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline long long clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline int64_t seq_of(const char *slot) { return __atomic_load_n((const int64_t *)slot, __ATOMIC_ACQUIRE); }

/* The presence table's word of rank `p`: the core it was last seen on, plus one (0: not known), in its low half; in
 * its high half a count of its posts and waits, which changes whenever the rank runs the mailbox. */
static inline uint64_t *presence(Box *box, int p) { return (uint64_t *)((char *)box->map.buf + box->table + 8 * p); }

/* This rank's core into the presence table (where the box has one), and one more to its count; the core, or -1. */
static inline int seen_here(Box *box) {
    if (box->table < 0)
        return -1;
    int cpu = sched_getcpu();
    uint64_t word = ((uint64_t)++box->activity << 32) | (uint32_t)(cpu + 1);
    __atomic_store_n(presence(box, box->rank), word, __ATOMIC_RELAXED);
    return cpu;
}

/* Whether the rank whose slot is at byte offset `at` was last seen on core `cpu` (this rank's): then it waits for
 * this core, and polling for it only delays it. */
static inline int shares_core(Box *box, Py_ssize_t at, int cpu) {
    if (box->table < 0 || cpu < 0)
        return 0;
    int p = (int)((at / box->slot) % (box->size + 1));
    return p < box->size && (uint32_t)__atomic_load_n(presence(box, p), __ATOMIC_RELAXED) == (uint32_t)(cpu + 1);
}

/* Post op `k` in `slot`: its sequence word (everything else of the post is written before it), then wake the ranks
 * that block on it, if any. The store and the read of the waiter count are ordered (a full barrier: `xchg`), as a
 * waiter's count and its read of the word are: either the waiter sees `k` and does not sleep, or the poster sees the
 * waiter and wakes it (a wake before it sleeps makes its FUTEX_WAIT return at once, the word having changed). The
 * fast path costs the barrier: no system call while nobody blocks. */
static void publish(Box *box, char *slot, long long k) {
    seen_here(box);
    __atomic_store_n((int64_t *)slot, (int64_t)k, __ATOMIC_SEQ_CST);
    if (__atomic_load_n((int32_t *)(slot + WAITERS_OFF), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, (int32_t *)slot, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Block on the sequence word of `slot` while it is below `k`, at most until `deadline` (CLOCK_MONOTONIC ns); the
 * poster wakes it (`publish`). The futex compares the word's low 32 bits, which change with every post. */
static void block_on(Box *box, char *slot, long long k, long long deadline) {
    int32_t *waiters = (int32_t *)(slot + WAITERS_OFF);
    __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    int64_t seen = __atomic_load_n((const int64_t *)slot, __ATOMIC_SEQ_CST);
    long long left = deadline - clock_ns();
    if (seen < k && left > 0) {
        struct timespec t = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
        syscall(SYS_futex, (int32_t *)slot, FUTEX_WAIT, (int32_t)(uint32_t)(uint64_t)seen, &t, NULL, 0);
        box->blocks++;
    }
    __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
}

/* One more wait whose yields took `ns` each (their time over their count: until the post, or all its turns), into the
 * average (a quarter per wait; one wait counts at most 1 ms), and whether the next waits yield: while the average is
 * at most `yield_limit`. The ranks themselves are the signal: a yield is cheap when the member it waits for runs on
 * this core and posts, or when nothing else of the job wants the core (microseconds), and costs a time slice of
 * another process (a millisecond or more) when the core goes to it: a busy loop beside the job. A wait for a member
 * that is late (a longer step of its own) yields quickly through its turns and then blocks: its yields stay cheap. There a rank that blocks leaves the core to whatever can use it and the kernel wakes it at the member's post, in
 * tens of microseconds. While the waits block, every `probe_every` ops one wait yields again (`probed`): where it was
 * cheap the average restarts from it and the waits yield again, and the next try comes twice as soon (from 16 ops on);
 * else twice as late, up to `probe_ops`. */
static void judge(Box *box, long long ns, int probed) {
    if (ns > 1000000)
        ns = 1000000;
    if (probed) {
        box->probes++;
        if (ns <= box->yield_limit) {
            box->yield_cost = ns;
            if (box->probe_every > box->probe_first)
                box->probe_every /= 2;
        } else {
            box->yield_cost += (ns - box->yield_cost) / 4;
            box->probe_every = 2 * box->probe_every < box->probe_ops ? 2 * box->probe_every : box->probe_ops;
        }
    } else {
        box->yield_cost += (ns - box->yield_cost) / 4;
    }
    box->yielding = box->yield_cost <= box->yield_limit;
    if (!box->yielding && box->next_probe <= box->ops)
        box->next_probe = box->ops + box->probe_every;
}

/* Index of the first of the `count` slots (byte offsets `at` in the mapping) whose sequence word is below k, from
 * `from`; `count` if none. */
static inline int first_missing(const char *base, const Py_ssize_t *at, int count, int from, long long k) {
    while (from < count && seq_of(base + at[from]) >= k)
        from++;
    return from;
}

/* Wait until the sequence words of the `count` slots at `at` all reach k: poll them for `poll_ns` (pause, no system
 * call: a peer running on another core posts within microseconds), then, where the box has `turns`, yield up to that
 * many times (a peer on this core runs) if yielding has been the cheaper way lately (`judge`), then block on the first
 * missing word until its poster wakes this rank, for `block_ns` in all. Whether every word reached k. Call it without
 * the GIL. */
static int wait_posts(Box *box, const char *base, const Py_ssize_t *at, int count, long long k, long long block_ns) {
    int i = first_missing(base, at, count, 0, k);
    if (i == count)
        return 1;
    long long start = clock_ns();
    int cpu = seen_here(box);
    if (box->poll_ns > 0) {
        for (;;) {
            if (shares_core(box, at[i], cpu)) {
                if (box->turns == 0)
                    move_off(box, cpu);  /* a core each: the pair should not stay stacked on one core */
                break;  /* the member it waits for was last seen on this core: let it run */
            }
            for (int j = 0; j < 64 && seq_of(base + at[i]) < k; j++)
                relax();
            if ((i = first_missing(base, at, count, i, k)) == count)
                return 1;
            if (clock_ns() - start >= box->poll_ns)
                break;
        }
    }
    int probed = box->turns > 0 && !box->yielding && box->ops >= box->next_probe;
    int yielded = box->turns > 0 && (box->yielding || probed);
    long long from = yielded ? clock_ns() : 0;
    if (probed)
        box->next_probe = box->ops + box->probe_every;  /* one try per op, whichever wait of it comes first */
    if (yielded) {
        for (int t = 1; t <= box->turns; t++) {
            sched_yield();
            if ((i = first_missing(base, at, count, i, k)) == count) {
                judge(box, (clock_ns() - from) / t, probed);
                return 1;
            }
        }
        judge(box, (clock_ns() - from) / box->turns, probed);
    }
    int done = 0;
    if (block_ns > 0) {
        long long deadline = clock_ns() + block_ns;
        for (;;) {
            if ((i = first_missing(base, at, count, i, k)) == count) {
                done = 1;
                break;
            }
            if (clock_ns() >= deadline)
                break;
            block_on(box, (char *)base + at[i], k, deadline);
            if (seen_here(box) != box->home && box->home >= 0)  /* woken wherever the kernel put it: back home */
                go_home(box);
        }
    }
    return done;
}

/* Box.wait(slots, k, seconds): wait_posts on the slots at byte offsets `slots` (a sequence), blocking up to
 * `seconds`, without the GIL. */
static PyObject *Box_wait(Box *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "wait(slots, k, seconds)");
        return NULL;
    }
    long long k = PyLong_AsLongLong(args[1]);
    double seconds = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (!self->open) {
        PyErr_SetString(PyExc_RuntimeError, "the mailbox was closed");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "slots must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t at[MAX_SIZE];
    if (count > MAX_SIZE) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many slots");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        at[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if ((at[i] == -1 && PyErr_Occurred()) || at[i] < 0 || at[i] % 8 || at[i] + WAITERS_OFF + 8 > self->map.len) {
            Py_DECREF(seq);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "slots: an offset outside the mapping or unaligned");
            return NULL;
        }
    }
    Py_DECREF(seq);
    int done;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    done = wait_posts(self, (const char *)self->map.buf, at, (int)count, k,
                      seconds > 0 ? (long long)(seconds * 1e9) : 0);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyBool_FromLong(done);
}

/* Box.publish(slot, k): op `k`'s sequence word into the slot at byte offset `slot`, waking its waiters. */
static PyObject *Box_publish(Box *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "publish(slot, k)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[0]);
    long long k = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (!self->open || at < 0 || at % 8 || at + WAITERS_OFF + 8 > self->map.len) {
        PyErr_SetString(PyExc_ValueError, "publish: the mailbox was closed or the slot is outside it");
        return NULL;
    }
    publish(self, (char *)self->map.buf + at, k);
    Py_RETURN_NONE;
}

static PyObject *Box_go_home(Box *self, PyObject *Py_UNUSED(unused)) {
    return PyBool_FromLong(go_home(self));
}

static PyObject *Box_close(Box *self, PyObject *Py_UNUSED(unused)) {
    while (self->busy) {  /* another thread's op waits without the GIL; it ends within its turns */
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
    }
    if (self->open) {
        self->open = 0;
        PyBuffer_Release(&self->map);
    }
    Py_RETURN_NONE;
}

static void Box_dealloc(Box *self) {
    if (self->open)
        PyBuffer_Release(&self->map);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Box_members[] = {
    {"ops", T_LONGLONG, offsetof(Box, ops), 0, "mailbox ops run so far in this group"},
    {"turns", T_INT, offsetof(Box, turns), READONLY, "turns a wait takes before the Python wait"},
    {"home", T_INT, offsetof(Box, home), 0, "this rank's core, which the ops keep it on (-1: none)"},
    {"moves", T_LONGLONG, offsetof(Box, moves), READONLY, "times an op moved this rank back to its home core"},
    {"blocks", T_LONGLONG, offsetof(Box, blocks), READONLY, "futex waits so far (a wait that blocked)"},
    {"yield_cost", T_LONGLONG, offsetof(Box, yield_cost), READONLY,
     "what a yield of the waits took lately (ns: an average over the last waits of their yields' mean time)"},
    {"yielding", T_INT, offsetof(Box, yielding), READONLY,
     "whether the waits yield before they block (where the box has turns): yield_cost is at most yield_limit_ns"},
    {"probes", T_LONGLONG, offsetof(Box, probes), READONLY, "waits that yielded to see whether yielding is cheap again"},
    {NULL},
};

static PyMethodDef Box_methods[] = {
    {"close", (PyCFunction)Box_close, METH_NOARGS, "Release the mapping (every op of this box then refuses to run)."},
    {"wait", (PyCFunction)(void (*)(void))Box_wait, METH_FASTCALL,
     "wait(slots, k, seconds): whether the sequence words of the slots at these byte offsets all reach k (polling, "
     "yielding, then blocking up to `seconds` until a poster wakes it), without the GIL."},
    {"publish", (PyCFunction)(void (*)(void))Box_publish, METH_FASTCALL,
     "publish(slot, k): write k into the sequence word of the slot at this byte offset and wake the ranks blocked "
     "on it."},
    {"go_home", (PyCFunction)Box_go_home, METH_NOARGS,
     "Move the calling thread to core `home` now if it runs elsewhere and its mask has it (what every 64th op does); "
     "whether it moved."},
    {NULL},
};

static PyTypeObject BoxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "axond.distributed.backends.tcp.shm._fastbox.Box",
    .tp_basicsize = sizeof(Box),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Box(mapping, turns): a group's mapped mailbox (a writable buffer) and its op counter `ops`.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Box_init,
    .tp_dealloc = (destructor)Box_dealloc,
    .tp_members = Box_members,
    .tp_methods = Box_methods,
};

/* ---------------------------------------------------------------- reductions */

typedef void (*reducer)(char *out, char **rows, int n, Py_ssize_t count, int op, int average);

#define FMIN(a, b) (((a) < (b) || isnan(a)) ? (a) : (b))
#define FMAX(a, b) (((a) > (b) || isnan(a)) ? (a) : (b))
#define IMIN(a, b) ((a) < (b) ? (a) : (b))
#define IMAX(a, b) ((a) > (b) ? (a) : (b))
/* Every member's row reduced into `out` in rank order; `out` (the caller's array) never overlaps the slots. */
#define LOOP(T, F)                                                               \
    do {                                                                         \
        T *restrict o = out;                                                     \
        const T *restrict a = (const T *)rows[0], *restrict b = (const T *)rows[1]; \
        for (Py_ssize_t i = 0; i < count; i++) o[i] = F(a[i], b[i]);             \
        for (int p = 2; p < n; p++) {                                            \
            const T *restrict r = (const T *)rows[p];                            \
            for (Py_ssize_t i = 0; i < count; i++) o[i] = F(o[i], r[i]);         \
        }                                                                        \
    } while (0)

#define SUM_F(a, b) ((a) + (b))
#define MUL_F(a, b) ((a) * (b))

static void reduce_f32(char *outp, char **rows, int n, Py_ssize_t count, int op, int average) {
    float *out = (float *)outp;
    switch (op) {
    case R_SUM: LOOP(float, SUM_F); break;
    case R_PRODUCT: LOOP(float, MUL_F); break;
    case R_MIN: LOOP(float, FMIN); break;
    case R_MAX: LOOP(float, FMAX); break;
    }
    if (average) {
        const float d = (float)n;  /* np.true_divide(x, n): n cast to float32 (NEP 50) */
        for (Py_ssize_t i = 0; i < count; i++) out[i] = out[i] / d;
    }
}

static void reduce_f64(char *outp, char **rows, int n, Py_ssize_t count, int op, int average) {
    double *out = (double *)outp;
    switch (op) {
    case R_SUM: LOOP(double, SUM_F); break;
    case R_PRODUCT: LOOP(double, MUL_F); break;
    case R_MIN: LOOP(double, FMIN); break;
    case R_MAX: LOOP(double, FMAX); break;
    }
    if (average) {
        const double d = (double)n;
        for (Py_ssize_t i = 0; i < count; i++) out[i] = out[i] / d;
    }
}

#define SUM_I32(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define MUL_I32(a, b) ((int32_t)((uint32_t)(a) * (uint32_t)(b)))
#define SUM_I64(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define MUL_I64(a, b) ((int64_t)((uint64_t)(a) * (uint64_t)(b)))

static void reduce_i32(char *outp, char **rows, int n, Py_ssize_t count, int op, int average) {
    int32_t *out = (int32_t *)outp;
    (void)average;  /* refused on integers (reducers.check_reduce_op) */
    switch (op) {
    case R_SUM: LOOP(int32_t, SUM_I32); break;
    case R_PRODUCT: LOOP(int32_t, MUL_I32); break;
    case R_MIN: LOOP(int32_t, IMIN); break;
    case R_MAX: LOOP(int32_t, IMAX); break;
    }
}

static void reduce_i64(char *outp, char **rows, int n, Py_ssize_t count, int op, int average) {
    int64_t *out = (int64_t *)outp;
    (void)average;
    switch (op) {
    case R_SUM: LOOP(int64_t, SUM_I64); break;
    case R_PRODUCT: LOOP(int64_t, MUL_I64); break;
    case R_MIN: LOOP(int64_t, IMIN); break;
    case R_MAX: LOOP(int64_t, IMAX); break;
    }
}

static const reducer REDUCERS[] = {NULL, reduce_f32, reduce_f64, reduce_i32, reduce_i64};
static const int ITEMSIZE[] = {1, 4, 8, 4, 8};

/* ---------------------------------------------------------------- posting a payload */

#define SAME_BLOCK 4096  /* post_copy compares and copies by blocks of this size */

/* slot <- the payload `src` (n bytes), skipping each block the slot already holds (from this rank's post two ops
 * ago, as with an unchanged input): its cache lines then stay shared with the peers that read them, which copy them
 * from their own caches again instead of from this core's. A block that changed differs at its first bytes in
 * the common case, so the comparison costs little where the data does change. */
static void post_copy(char *slot, const char *src, Py_ssize_t n) {
    Py_ssize_t at = 0;
    for (; at + SAME_BLOCK <= n; at += SAME_BLOCK)
        if (memcmp(slot + at, src + at, SAME_BLOCK) != 0)
            memcpy(slot + at, src + at, SAME_BLOCK);
    if (at < n && memcmp(slot + at, src + at, n - at) != 0)
        memcpy(slot + at, src + at, n - at);
}

/* ---------------------------------------------------------------- Op: one prepared call shape */

typedef struct {
    PyObject_HEAD
    Box *box;
    int kind, rank, size, root, dtype, redop, average;
    Py_ssize_t slots[2][MAX_SIZE];  /* byte offset of every rank's slot in each buffer */
    char header[HEAD_BYTES];        /* this call shape's header fields, the sequence number 0 */
    Py_ssize_t posted;              /* payload bytes this rank posts */
    Py_ssize_t nbytes;              /* bytes of the array `run` takes (all_gather: the whole output) */
    Py_ssize_t out_bytes;           /* reduce_scatter: bytes of its output */
    Py_ssize_t count;               /* elements a reduction reduces */
    Py_ssize_t part;                /* reduce_scatter: byte offset of this rank's part in a payload */
    int64_t pid;                    /* single copy: this process, as the peers read it */
    int failed;                     /* single copy: the peer whose buffer the last failed read was of */
    char *bounce;                   /* single copy: reads at a slow distance go through it (allocated on first use) */
} Op;

static int Op_init(Op *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"box", "kind", "rank", "size", "slots", "header", "posted", "nbytes", "root", "dtype",
                            "redop", "average", "count", "part", "out_bytes", NULL};
    PyObject *box, *slots;
    const char *header;
    Py_ssize_t header_len;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!iiiOy#nniiiinnn", names, &BoxType, &box, &self->kind,
                                     &self->rank, &self->size, &slots, &header, &header_len, &self->posted,
                                     &self->nbytes, &self->root, &self->dtype, &self->redop, &self->average,
                                     &self->count, &self->part, &self->out_bytes))
        return -1;
    if (self->kind < 0 || self->kind >= K_KINDS || self->size < 2 || self->size > MAX_SIZE || self->rank < 0 ||
        self->rank >= self->size || self->root < 0 || self->root >= self->size || header_len != HEAD_BYTES ||
        self->dtype < D_NONE || self->dtype > D_I64 || self->redop < 0 || self->redop >= R_OPS ||
        self->posted < 0 || self->nbytes < 0 || self->count < 0 || self->part < 0 || self->out_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "Op: a field is out of range");
        return -1;
    }
    Py_ssize_t reduced = self->count * ITEMSIZE[self->dtype];
    int fits;  /* the sizes agree with each other, as mailbox_ops makes them */
    switch (self->kind) {
    case K_ALL_REDUCE: fits = self->dtype != D_NONE && reduced == self->posted && self->nbytes == self->posted; break;
    case K_REDUCE_SCATTER:
        fits = self->dtype != D_NONE && reduced == self->out_bytes && self->nbytes == self->posted &&
               self->part + reduced <= self->posted;
        break;
    case K_BCAST_ROOT: fits = self->nbytes == self->posted; break;
    case K_BCAST_LEAF: fits = self->posted == 0; break;
    case K_ALL_GATHER: fits = self->nbytes == self->size * self->posted; break;
    case K_SC_BCAST: fits = self->posted == SC_POSTED; break;
    case K_SC_ALL_GATHER: fits = self->posted == SC_POSTED && self->nbytes % self->size == 0; break;
    default: fits = self->posted == 0; break;
    }
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "Op: the sizes do not fit the kind");
        return -1;
    }
    Py_ssize_t span = self->kind == K_BCAST_LEAF ? self->nbytes : self->posted;  /* payload bytes read or written */
    PyObject *seq = PySequence_Fast(slots, "slots must be a sequence");
    if (seq == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != 2 * self->size) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "slots: one offset per rank and buffer (2 * size)");
        return -1;
    }
    Box *b = (Box *)box;
    for (int i = 0; i < 2 * self->size; i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (at == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (at < 0 || at % 8 || at + PAYLOAD_OFF + span > b->map.len) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "slots: an offset outside the mapping or unaligned");
            return -1;
        }
        self->slots[i / self->size][i % self->size] = at;
    }
    Py_DECREF(seq);
    memcpy(self->header, header, HEAD_BYTES);
    self->pid = (int64_t)getpid();
    self->failed = -1;
    Py_INCREF(box);
    Py_XSETREF(self->box, b);
    return 0;
}

static void Op_dealloc(Op *self) {
    free(self->bounce);
    Py_XDECREF(self->box);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The array argument of `run` or `finish`: a C-contiguous buffer of `len` bytes, writable if `writable`, aligned
 * for a reduction. 1: taken; 0: not for the C path (nothing done; the Python path runs instead); -1: error. */
static int take(Op *self, PyObject *obj, Py_buffer *view, Py_ssize_t len, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        /* not contiguous, read-only, no buffer: the Python path runs the call and says what is wrong */
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError) ||
            PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (view->len != len || ((uintptr_t)view->buf) % ITEMSIZE[self->dtype]) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Read what the op needs from every member's slot of buffer `buf`. */
static void consume(Op *self, int buf, char *a, char *b) {
    char *base = (char *)self->box->map.buf;
    char *rows[MAX_SIZE];
    int n = self->size;
    switch (self->kind) {
    case K_ALL_REDUCE:
        for (int p = 0; p < n; p++) rows[p] = base + self->slots[buf][p] + PAYLOAD_OFF;
        REDUCERS[self->dtype](a, rows, n, self->count, self->redop, self->average);
        break;
    case K_REDUCE_SCATTER:
        for (int p = 0; p < n; p++) rows[p] = base + self->slots[buf][p] + PAYLOAD_OFF + self->part;
        REDUCERS[self->dtype](b, rows, n, self->count, self->redop, self->average);
        break;
    case K_BCAST_LEAF:
        memcpy(a, base + self->slots[buf][self->root] + PAYLOAD_OFF, self->nbytes);
        break;
    case K_ALL_GATHER:
        for (int p = 0; p < n; p++)
            if (p != self->rank)
                memcpy(a + p * self->posted, base + self->slots[buf][p] + PAYLOAD_OFF, self->posted);
        break;
    default:
        break;
    }
}

/* Whether every member posted op `k` within the box's first wait (`wait_posts`: polling, yielding, then blocking up
 * to `block_ns`; without the GIL). */
static int arrived(Op *self, int buf, long long k) {
    const char *base = (const char *)self->box->map.buf;
    Py_ssize_t at[MAX_SIZE];
    int count = 0;
    for (int p = 0; p < self->size; p++)
        if (p != self->rank)
            at[count++] = self->slots[buf][p];
    if (first_missing(base, at, count, 0, k) == count)
        return 1;
    int all;
    Py_BEGIN_ALLOW_THREADS
    all = wait_posts(self->box, base, at, count, k, self->box->block_ns);
    Py_END_ALLOW_THREADS
    return all;
}

/* A broadcast member's copy of the root's payload of op `k` (buffer `buf`) into `out` while the root still writes
 * it: whatever its progress word (or, from a root on the Python path, its sequence word: everything) says is there,
 * once the root's call is checked to be this rank's. Whether it copied everything within the box's turns (a turn is
 * spent only on a look that found nothing new); if not (a late or mismatched root), the caller settles and
 * `finish` copies it all. Without the GIL: it touches only the mapping and `out`. */
static int pipelined(Op *self, int buf, long long k, char *out) {
    char *base = (char *)self->box->map.buf;
    char *root = base + self->slots[buf][self->root];
    const char *mine = base + self->slots[buf][self->rank] + HEAD_OFF;
    const int64_t *seq = (const int64_t *)root, *progress = (const int64_t *)(root + PROGRESS_OFF);
    Py_ssize_t copied = 0, total = self->nbytes;
    Box *box = self->box;
    int turns = box->yielding ? box->turns : 0, ok = 1;
    long long polled = 0, poll_ns = box->poll_ns;
    PyThreadState *released = PyEval_SaveThread();
    int cpu = seen_here(box);
    while (copied < total) {
        Py_ssize_t there = 0;
        if (__atomic_load_n(seq, __ATOMIC_ACQUIRE) >= k) {
            there = total;
        } else {
            uint64_t p = (uint64_t)__atomic_load_n(progress, __ATOMIC_ACQUIRE);
            if ((long long)(p >> 32) == k)
                there = (Py_ssize_t)(p & 0xFFFFFFFFu) < total ? (Py_ssize_t)(p & 0xFFFFFFFFu) : total;
        }
        if (there > copied) {
            if (copied == 0 && memcmp(root + HEAD_OFF, mine, CALL_BYTES) != 0) {
                ok = 0;  /* another call: the Python wait raises, naming both */
                break;
            }
            memcpy(out + copied, root + PAYLOAD_OFF + copied, there - copied);
            copied = there;
            polled = 0;
        } else if (poll_ns > 0 && (polled == 0 || clock_ns() - polled < poll_ns) &&
                   !shares_core(box, self->slots[buf][self->root], cpu)) {
            if (polled == 0)
                polled = clock_ns();
            for (int j = 0; j < 64; j++)
                relax();
        } else if (turns-- > 0) {
            sched_yield();
        } else {
            /* nothing new for a while: the root is not running; block until its post wakes this rank (its sequence
             * word comes after the whole payload) */
            Py_ssize_t at = self->slots[buf][self->root];
            if (!wait_posts(box, base, &at, 1, k, box->block_ns)) {
                ok = 0;
                break;
            }
        }
    }
    PyEval_RestoreThread(released);
    return ok;
}

/* Whether every member posted this rank's call (the header's first 8 fields) in buffer `buf`. */
static int same_calls(Op *self, int buf) {
    char *base = (char *)self->box->map.buf;
    const char *mine = base + self->slots[buf][self->rank] + HEAD_OFF;
    for (int p = 0; p < self->size; p++)
        if (p != self->rank && memcmp(base + self->slots[buf][p] + HEAD_OFF, mine, CALL_BYTES) != 0)
            return 0;
    return 1;
}

/* The arrays of a call of this kind: `a` (the op's array: all_reduce's x, broadcast's x, all_gather's output,
 * reduce_scatter's input) and `b` (reduce_scatter's output). */
static int take_arrays(Op *self, PyObject *a_obj, PyObject *b_obj, Py_buffer *a, Py_buffer *b, int *have_a,
                       int *have_b) {
    *have_a = *have_b = 0;
    if (self->kind == K_BARRIER)
        return 1;
    if (a_obj == NULL || a_obj == Py_None) {
        PyErr_SetString(PyExc_TypeError, "this op takes an array");
        return -1;
    }
    int writable = self->kind != K_BCAST_ROOT && self->kind != K_REDUCE_SCATTER &&
                   !(self->kind == K_SC_BCAST && self->rank == self->root);
    int got = take(self, a_obj, a, self->nbytes, writable);
    if (got <= 0)
        return got;
    *have_a = 1;
    if (self->kind == K_REDUCE_SCATTER) {
        if (b_obj == NULL || b_obj == Py_None) {
            PyBuffer_Release(a);
            *have_a = 0;
            PyErr_SetString(PyExc_TypeError, "reduce_scatter takes an output array");
            return -1;
        }
        got = take(self, b_obj, b, self->out_bytes, 1);
        if (got <= 0) {
            PyBuffer_Release(a);
            *have_a = 0;
            return got;
        }
        *have_b = 1;
    } else if ((self->kind == K_ALL_GATHER || self->kind == K_SC_ALL_GATHER) && b_obj != NULL && b_obj != Py_None) {
        /* this rank's block, which `run` copies into its row */
        got = take(self, b_obj, b, self->kind == K_ALL_GATHER ? self->posted : self->nbytes / self->size, 0);
        if (got <= 0) {
            PyBuffer_Release(a);
            *have_a = 0;
            return got;
        }
        *have_b = 1;
    }
    return 1;
}

static void release(Py_buffer *a, Py_buffer *b, int have_a, int have_b) {
    if (have_a)
        PyBuffer_Release(a);
    if (have_b)
        PyBuffer_Release(b);
}

/* ---------------------------------------------------------------- single copy (single_copy_ops in C) */

/* dst <- n bytes of src (not overlapping), as host_copy.large_copy: x86's `rep movsb` from STRING_MIN bytes at the
 * page distances where it is fast (glibc's memcpy streams past the caches at such sizes), else memcpy. */
#define STRING_MIN (1 << 20)  /* distributed/policy.py STRING_MIN_BYTES */
static void large_copy(char *dst, const char *src, Py_ssize_t n) {
#if defined(__x86_64__)
    uintptr_t distance = ((uintptr_t)dst - (uintptr_t)src) % PAGE;
    if (n >= STRING_MIN && (distance == 0 || distance >= SLOW_DISTANCE)) {
        size_t count = (size_t)n;
        __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(count) : : "memory");
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* len bytes between `local` and `remote` in process `pid`: read into `local` (process_vm_readv, as
 * single_copy.Reader.read) or, with `write`, written from it (process_vm_writev). Where the kernel's string copy would
 * take its slow case (the destination 1..31 bytes after the source, mod PAGE), through the bounce buffer at half a
 * page from `remote`. 0, or -1 with errno set. */
static int cma(Op *self, int write, int64_t pid, uintptr_t remote, char *local, Py_ssize_t len) {
    Py_ssize_t done = 0;
    uintptr_t distance = (write ? remote - (uintptr_t)local : (uintptr_t)local - remote) % PAGE;
    if (len >= BOUNCE_MIN && distance != 0 && distance < SLOW_DISTANCE) {
        if (self->bounce == NULL && (self->bounce = aligned_alloc(PAGE, BOUNCE_BYTES + PAGE)) == NULL) {
            errno = ENOMEM;
            return -1;
        }
        char *bounce = self->bounce + (remote + PAGE / 2 - (uintptr_t)self->bounce) % PAGE;
        while (done < len) {
            Py_ssize_t m = len - done < BOUNCE_BYTES ? len - done : BOUNCE_BYTES;
            if (write)
                large_copy(bounce, local + done, m);
            if (cma(self, write, pid, remote + done, bounce, m) < 0)  /* half a page apart: no bounce again */
                return -1;
            if (!write)
                large_copy(local + done, bounce, m);
            done += m;
        }
        return 0;
    }
    while (done < len) {
        struct iovec near = {local + done, (size_t)(len - done)}, far = {(void *)(remote + done), (size_t)(len - done)};
        ssize_t got = write ? process_vm_writev((pid_t)pid, &near, 1, &far, 1, 0)
                            : process_vm_readv((pid_t)pid, &near, 1, &far, 1, 0);
        if (got <= 0) {
            if (got == 0)
                errno = EFAULT;
            return -1;
        }
        done += got;
    }
    return 0;
}

/* Peer `p`'s publication in buffer `buf`: pid, address, bytes, memfd, token, offset. */
static const int64_t *published(Op *self, int buf, int p) {
    return (const int64_t *)((char *)self->box->map.buf + self->slots[buf][p] + PAYLOAD_OFF);
}

/* Bytes `from`..`to` of peer `p`'s buffer published in buffer `buf` into `dst`. 0, or -1 with errno set (EMSGSIZE:
 * it published fewer bytes). */
static int sc_read_peer(Op *self, int buf, int p, char *dst, Py_ssize_t from, Py_ssize_t to) {
    const int64_t *words = published(self, buf, p);
    self->failed = p;
    if (words[2] < to) {
        errno = EMSGSIZE;
        return -1;
    }
    return cma(self, 0, words[0], (uintptr_t)words[1] + from, dst + from, to - from);
}

/* A two-rank broadcast's member publishes SPLIT as its token (with memfd -1): the root writes the second part of each
 * such member's buffer while the member reads the first (both cores copy); a root that published it writes the part,
 * a member that published it has it written. Members on the Python path publish token 0 (memfd -1) and read all. */
#define SPLIT 0x53504c4954LL

static int splits(const int64_t *words) { return words[3] == -1 && words[4] == SPLIT; }

/* Where the root's part of a split broadcast starts in the member's buffer at `address`: the middle, at a cache line. */
static Py_ssize_t split_at(uintptr_t address, Py_ssize_t nbytes) {
    return (Py_ssize_t)(((address + (uintptr_t)nbytes / 2) & ~(uintptr_t)63) - address);
}

/* The reads of a single-copy op whose publications (buffer `buf`) every member posted: broadcast, the root's buffer
 * into `a`; all_gather, every peer's block into its row of `a` (starting at the next rank's, as single_copy_ops).
 * Without the GIL. 0, or -1 with an OSError set (the peer in `failed`). */
static int sc_reads(Op *self, int buf, char *a) {
    int rc = 0, n = self->size;
    PyThreadState *released = PyEval_SaveThread();
    if (self->kind == K_SC_BCAST && self->rank != self->root) {
        int split = splits(published(self, buf, self->root)) && splits(published(self, buf, self->rank));
        rc = sc_read_peer(self, buf, self->root, a, 0, split ? split_at((uintptr_t)a, self->nbytes) : self->nbytes);
    } else if (self->kind == K_SC_BCAST) {
        for (int p = 0; p < n && rc == 0; p++) {
            const int64_t *words = published(self, buf, p);
            if (p == self->rank || !splits(published(self, buf, self->rank)) || !splits(words))
                continue;
            self->failed = p;
            Py_ssize_t at = split_at((uintptr_t)words[1], self->nbytes);
            if (words[2] < self->nbytes) {
                errno = EMSGSIZE;
                rc = -1;
            } else {
                rc = cma(self, 1, words[0], (uintptr_t)words[1] + at, a + at, self->nbytes - at);
            }
        }
    } else {
        Py_ssize_t block = self->nbytes / n;
        for (int k = 1; k < n && rc == 0; k++) {
            int p = (self->rank + k) % n;
            rc = sc_read_peer(self, buf, p, a + p * block, 0, block);
        }
    }
    PyEval_RestoreThread(released);
    if (rc < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->failed = -1;
    return 0;
}

/* A single-copy op (see run): publish, read, post again. */
static PyObject *sc_run(Op *self, long long seq, Py_buffer *a, Py_buffer *b, int have_b) {
    Box *box = self->box;
    char *base = (char *)box->map.buf;
    long long k = ++box->ops;
    int buf = (int)(k & 1);
    char *me = base + self->slots[buf][self->rank];
    Py_ssize_t block = self->nbytes / self->size;
    char *row = (char *)a->buf + (Py_ssize_t)self->rank * block;
    const char *mine = (const char *)a->buf;
    if (self->kind == K_SC_ALL_GATHER) {
        mine = row;
        if (have_b && b->buf != row) {
            char *start = (char *)a->buf, *end = start + self->nbytes, *given = (char *)b->buf;
            if (given + block <= start || given >= end)
                mine = given;  /* the peers read the block given apart while this rank copies it into its row */
            else
                memmove(row, given, block);  /* inside the output, elsewhere: into the row first */
        }
    }
    memcpy(me + HEAD_OFF, self->header, HEAD_BYTES);
    *(int64_t *)(me + SEQ_OFF) = seq & 0xFFFFFFFFLL;
    int64_t *words = (int64_t *)(me + PAYLOAD_OFF);
    words[0] = self->pid;
    words[1] = (int64_t)(uintptr_t)mine;
    words[2] = self->kind == K_SC_BCAST ? self->nbytes : block;
    words[3] = -1;
    words[4] = self->kind == K_SC_BCAST && self->size == 2 ? SPLIT : 0;
    words[5] = 0;
    publish(box, me, k);
    if (mine != row && self->kind == K_SC_ALL_GATHER)
        large_copy(row, mine, block);
    if (!(arrived(self, buf, k) && same_calls(self, buf)))
        return PyLong_FromLong(buf);
    if (sc_reads(self, buf, (char *)a->buf) < 0)
        return NULL;
    k = ++box->ops;  /* every member finished reading: the same call, without payload */
    buf = (int)(k & 1);
    me = base + self->slots[buf][self->rank];
    memcpy(me + HEAD_OFF, self->header, HEAD_BYTES);
    *(int64_t *)(me + SEQ_OFF) = seq & 0xFFFFFFFFLL;
    *(int64_t *)(me + POSTED_OFF) = 0;
    publish(box, me, k);
    if (!(arrived(self, buf, k) && same_calls(self, buf)))
        return PyLong_FromLong(2 + buf);
    Py_RETURN_NONE;
}

/* run(seq, a=None, b=None): this shape's call number `seq` (all_gather: `a` the output, `b` this rank's block or
 * None if it is in its row already; reduce_scatter: `a` the input, `b` the output). None: done. -1: nothing done
 * (an array the C path does not take: the Python path runs the call). 0 or 1: posted in that buffer, but a member was
 * late or posted another call: the caller settles (Mailbox.settle) and then calls finish(buf, a, b) (single copy:
 * which reads; the caller then posts the second time). Single copy only: 2 or 3, the second post (in buffer 0 or 1)
 * waits for a member: the caller settles it. A failed read raises OSError (the peer: `failed`). */
static PyObject *Op_run(Op *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "run(seq, a=None, b=None)");
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[0]);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    Box *box = self->box;
    if (!box->open)
        return PyLong_FromLong(-1);
    Py_buffer a, b;
    int have_a, have_b;
    int got = take_arrays(self, nargs > 1 ? args[1] : NULL, nargs > 2 ? args[2] : NULL, &a, &b, &have_a, &have_b);
    if (got <= 0)
        return got < 0 ? NULL : PyLong_FromLong(-1);
    keep_home(box);
    box->busy++;
    if (self->kind == K_SC_BCAST || self->kind == K_SC_ALL_GATHER) {
        PyObject *result = sc_run(self, seq, &a, &b, have_b);
        box->busy--;
        release(&a, &b, have_a, have_b);
        return result;
    }
    char *base = (char *)box->map.buf;
    long long k = ++box->ops;
    int buf = (int)(k & 1);
    char *me = base + self->slots[buf][self->rank];
    memcpy(me + HEAD_OFF, self->header, HEAD_BYTES);
    *(int64_t *)(me + SEQ_OFF) = seq & 0xFFFFFFFFLL;
    if (self->kind == K_BCAST_ROOT && self->posted > CHUNK) {
        /* chunk by chunk, each followed by the progress word (op number, bytes written): the members copy out what
         * is there while the rest comes in (see `pipelined`) */
        int64_t *progress = (int64_t *)(me + PROGRESS_OFF);
        for (Py_ssize_t at = 0; at < self->posted; at += CHUNK) {
            Py_ssize_t n = self->posted - at < CHUNK ? self->posted - at : CHUNK;
            post_copy(me + PAYLOAD_OFF + at, (const char *)a.buf + at, n);
            __atomic_store_n(progress, (int64_t)(((uint64_t)k << 32) | (uint64_t)(at + n)), __ATOMIC_RELEASE);
        }
    } else if (self->posted) {
        const char *src = (const char *)a.buf;
        if (self->kind == K_ALL_GATHER)
            src = have_b ? (const char *)b.buf : (const char *)a.buf + (Py_ssize_t)self->rank * self->posted;
        post_copy(me + PAYLOAD_OFF, src, self->posted);
    }
    /* last: a peer that sees the sequence number sees the rest (x86 store order; the barrier keeps the compiler's
     * order too), and a peer blocked on it wakes */
    publish(box, me, k);
    if (self->kind == K_ALL_GATHER && have_b) {  /* the block given apart, into this rank's row: while the peers read */
        char *row = (char *)a.buf + (Py_ssize_t)self->rank * self->posted;
        if (row != (char *)b.buf)  /* the block may be a view of the output (torch's all_gather_into_tensor) */
            memmove(row, b.buf, self->posted);
    }
    int done;
    if (self->kind == K_BCAST_LEAF && self->nbytes > CHUNK)
        done = pipelined(self, buf, k, (char *)a.buf) && arrived(self, buf, k) && same_calls(self, buf);
    else if ((done = arrived(self, buf, k) && same_calls(self, buf)))
        consume(self, buf, have_a ? (char *)a.buf : NULL, have_b ? (char *)b.buf : NULL);
    box->busy--;
    release(&a, &b, have_a, have_b);
    if (!done)
        return PyLong_FromLong(buf);
    Py_RETURN_NONE;
}

/* finish(buf, a=None, b=None): read what the op needs from buffer `buf`, after the caller settled it. */
static PyObject *Op_finish(Op *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "finish(buf, a=None, b=None)");
        return NULL;
    }
    long buf = PyLong_AsLong(args[0]);
    if (buf == -1 && PyErr_Occurred())
        return NULL;
    if (buf != 0 && buf != 1) {
        PyErr_SetString(PyExc_ValueError, "buf is 0 or 1");
        return NULL;
    }
    if (!self->box->open) {
        PyErr_SetString(PyExc_RuntimeError, "the mailbox was closed");
        return NULL;
    }
    Py_buffer a, b;
    int have_a, have_b;
    int got = take_arrays(self, nargs > 1 ? args[1] : NULL, nargs > 2 ? args[2] : NULL, &a, &b, &have_a, &have_b);
    if (got <= 0) {
        if (got == 0)
            PyErr_SetString(PyExc_ValueError, "finish: not the arrays this op ran with");
        return NULL;
    }
    int rc = 0;
    if (self->kind == K_SC_BCAST || self->kind == K_SC_ALL_GATHER)
        rc = sc_reads(self, (int)buf, (char *)a.buf);
    else
        consume(self, (int)buf, have_a ? (char *)a.buf : NULL, have_b ? (char *)b.buf : NULL);
    release(&a, &b, have_a, have_b);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Op_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Op_run, METH_FASTCALL,
     "run(seq, a=None, b=None): None (done), -1 (not taken: run it in Python) or the buffer to settle, then finish."},
    {"finish", (PyCFunction)(void (*)(void))Op_finish, METH_FASTCALL,
     "finish(buf, a=None, b=None): read the op's result from buffer `buf` once it is settled."},
    {NULL},
};

static PyMemberDef Op_members[] = {
    {"box", T_OBJECT, offsetof(Op, box), READONLY, "the Box this op posts in"},
    {"failed", T_INT, offsetof(Op, failed), READONLY, "single copy: the peer whose read failed last (-1: none)"},
    {NULL},
};

static PyTypeObject OpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "axond.distributed.backends.tcp.shm._fastbox.Op",
    .tp_basicsize = sizeof(Op),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A prepared mailbox op of one call shape (see mailbox_ops.Prepared).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Op_init,
    .tp_dealloc = (destructor)Op_dealloc,
    .tp_methods = Op_methods,
    .tp_members = Op_members,
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_fastbox",
    .m_doc = "The prepared mailbox ops in C (see mailbox_ops.Prepared).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__fastbox(void) {
    if (PyType_Ready(&BoxType) < 0 || PyType_Ready(&OpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BoxType);
    Py_INCREF(&OpType);
    if (PyModule_AddObject(m, "Box", (PyObject *)&BoxType) < 0 || PyModule_AddObject(m, "Op", (PyObject *)&OpType) < 0)
        return NULL;
    struct { const char *name; int value; } constants[] = {
        {"ALL_REDUCE", K_ALL_REDUCE}, {"BROADCAST_ROOT", K_BCAST_ROOT}, {"BROADCAST_LEAF", K_BCAST_LEAF},
        {"ALL_GATHER", K_ALL_GATHER}, {"REDUCE_SCATTER", K_REDUCE_SCATTER}, {"BARRIER", K_BARRIER},
        {"SC_BROADCAST", K_SC_BCAST}, {"SC_ALL_GATHER", K_SC_ALL_GATHER}, {"SC_POSTED", SC_POSTED},
        {"SUM", R_SUM}, {"PRODUCT", R_PRODUCT}, {"MIN", R_MIN}, {"MAX", R_MAX},
        {"FLOAT32", D_F32}, {"FLOAT64", D_F64}, {"INT32", D_I32}, {"INT64", D_I64}, {"NO_DTYPE", D_NONE},
        {"MAX_SIZE", MAX_SIZE}, {"HEAD_BYTES", HEAD_BYTES}, {"PAYLOAD_OFFSET", PAYLOAD_OFF},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0)
            return NULL;
    /* the slot layout as this build has it, checked against mailbox.LAYOUT offset by offset (on import and in
     * tests/docs_quality/test_mailbox_layout.py) */
    PyObject *layout = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "HEAD_OFF", HEAD_OFF, "HEAD_BYTES", HEAD_BYTES,
                                     "CALL_BYTES", CALL_BYTES, "SEQ_OFF", SEQ_OFF, "POSTED_OFF", POSTED_OFF,
                                     "PROGRESS_OFF", PROGRESS_OFF, "WAITERS_OFF", WAITERS_OFF,
                                     "PAYLOAD_OFF", PAYLOAD_OFF);
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0)
        return NULL;
    return m;
}

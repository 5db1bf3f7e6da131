/* Drives the tbrdma NCCL net plugin exactly as NCCL's proxy thread does, with no NCCL and no
 * GPU: one process per rank (two ranks, in two network namespaces), a TCP socket standing in
 * for NCCL's bootstrap (it carries 128-byte handles and barriers only).
 *
 *   harness DIR RANK PEER_IP OOB_PORT VERSIONS
 *
 * DIR holds the plugin under both installed names; RANK is 0 (bootstrap server) or 1; VERSIONS
 * is a comma-separated list of 8, 9, 10, 11. For each version, through that version's struct:
 * init (twice), devices, getProperties; the GDR-probe style loopback (listen, connect, accept
 * from one thread); both ranks listen and connect to each other with the connect/accept retry
 * loop; NCCL's proxy pattern (8 slots of 512 KiB, receives posted with the full slot size,
 * *request preset to NULL or 0x1, random sizes including runs of 0 bytes, only the oldest
 * request tested); 32 sends posted long before their receives and the reverse; a flood of
 * small messages sent while the peer posts no receive (flow control); sizes from 0 B to 8 MiB;
 * a send larger than the posted receive (the receive fails with ncclInvalidUsage, and so does
 * the send when it went by rendezvous; the next message still works); deregMr and the closes.
 * Then dlclose, dlopen, init again. Every byte received is checked. Prints "harness: all
 * checks passed" and exits 0, or says what failed and exits 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "net_api.h"

#define MIB (1u << 20)
#define REGION (16 * MIB)
#define SLOT (512 * 1024)
#define STEPS 8

static int rank;
static int oob = -1;
static int version;
static const char *vname = "";
static void *table;
static void *ctx11; /* v11 context */
static int logged_init;

#define FAIL(...)                                                    \
  do {                                                               \
    fprintf(stderr, "harness rank %d v%d: ", rank, version);         \
    fprintf(stderr, __VA_ARGS__);                                    \
    fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);               \
    exit(1);                                                         \
  } while (0)
#define CHECK(call)                                                  \
  do {                                                               \
    ncclResult_t r_ = (call);                                        \
    if (r_ != ncclSuccess) FAIL("%s returned %d", #call, r_);        \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---- NCCL's logger ---------------------------------------------------------------------- */

static void logger(int level, unsigned long flags, const char *file, int line, const char *fmt,
                   ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (strstr(msg, "tbrdma NET: initialized")) logged_init = 1;
  printf("[nccl log level %d flags %#lx %s:%d] %s\n", level, flags, file, line, msg);
  fflush(stdout);
}

/* ---- bootstrap stand-in ----------------------------------------------------------------- */

static void oob_setup(const char *peer_ip, int port) {
  if (rank == 0) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1)) FAIL("oob listen: %s", strerror(errno));
    oob = accept(l, NULL, NULL);
    close(l);
  } else {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, peer_ip, &a.sin_addr);
    for (int i = 0; i < 500; i++) {
      oob = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(oob, (struct sockaddr *)&a, sizeof a) == 0) break;
      close(oob);
      oob = -1;
      usleep(20000);
    }
  }
  if (oob < 0) FAIL("no bootstrap connection");
  int one = 1;
  setsockopt(oob, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void oob_xchg(const void *mine, void *theirs, size_t len) {
  if (write(oob, mine, len) != (ssize_t)len) FAIL("oob write");
  size_t got = 0;
  while (got < len) {
    ssize_t n = read(oob, (char *)theirs + got, len - got);
    if (n <= 0) FAIL("oob read: peer gone");
    got += n;
  }
}

static void barrier(void) {
  char a = 'b', b;
  oob_xchg(&a, &b, 1);
}

/* ---- one API over every version's struct ------------------------------------------------ */

#define T8 ((ncclNet_v8_t *)table)
#define T9 ((ncclNet_v9_t *)table)
#define T10 ((ncclNet_v10_t *)table)
#define T11 ((ncclNet_v11_t *)table)
#define PICK(f) (version == 8 ? (void *)T8->f : version == 9 ? (void *)T9->f : version == 10 ? (void *)T10->f : (void *)T11->f)

static ncclResult_t n_init(void) {
  switch (version) {
    case 8: return T8->init(logger);
    case 9: return T9->init(logger);
    case 10: return T10->init(logger, NULL);
    default: {
      ncclNetCommConfig_t config = {-1};
      return T11->init(&ctx11, 0x1234, &config, logger, NULL);
    }
  }
}
static ncclResult_t n_devices(int *n) { return ((ncclResult_t(*)(int *))PICK(devices))(n); }
static ncclResult_t n_listen(void *handle, void **lc) {
  if (version == 11) return T11->listen(ctx11, 0, handle, lc);
  return ((ncclResult_t(*)(int, void *, void **))PICK(listen))(0, handle, lc);
}
static ncclResult_t n_connect(void *handle, void **sc) {
  /* The device-handle argument is NULL, as in NCCL's GDR probe. */
  switch (version) {
    case 8: return T8->connect(0, handle, sc, NULL);
    case 9: return T9->connect(0, handle, sc, NULL);
    case 10: return T10->connect(0, NULL, handle, sc, NULL);
    default: return T11->connect(ctx11, 0, handle, sc, NULL);
  }
}
static ncclResult_t n_accept(void *lc, void **rc) {
  return ((ncclResult_t(*)(void *, void **, void **))PICK(accept))(lc, rc, NULL);
}
static ncclResult_t n_regmr(void *comm, void *data, size_t size, void **mh) {
  return ((ncclResult_t(*)(void *, void *, size_t, int, void **))PICK(regMr))(comm, data, size, NCCL_PTR_HOST, mh);
}
static ncclResult_t n_deregmr(void *comm, void *mh) {
  return ((ncclResult_t(*)(void *, void *))PICK(deregMr))(comm, mh);
}
static ncclResult_t n_isend(void *sc, void *data, size_t size, void *mh, void **req) {
  switch (version) {
    case 8: return T8->isend(sc, data, (int)size, rank, mh, req);
    case 9: return T9->isend(sc, data, size, rank, mh, req);
    case 10: return T10->isend(sc, data, size, rank, mh, NULL, req);
    default: return T11->isend(sc, data, size, rank, mh, NULL, req);
  }
}
static ncclResult_t n_irecv(void *rc, void *data, size_t size, void *mh, void **req) {
  int tag = 1 - rank;
  void *datas[1] = {data};
  void *mhs[1] = {mh};
  void *phs[1] = {NULL};
  switch (version) {
    case 8: {
      int sz = (int)size;
      return T8->irecv(rc, 1, datas, &sz, &tag, mhs, req);
    }
    case 9: return T9->irecv(rc, 1, datas, &size, &tag, mhs, req);
    case 10: return T10->irecv(rc, 1, datas, &size, &tag, mhs, phs, req);
    default: return T11->irecv(rc, 1, datas, &size, &tag, mhs, phs, req);
  }
}
static ncclResult_t n_test(void *req, int *done, int *size) {
  return ((ncclResult_t(*)(void *, int *, int *))PICK(test))(req, done, size);
}
static ncclResult_t n_close(void *comm, int which) {
  void *f = which == 0 ? PICK(closeSend) : which == 1 ? PICK(closeRecv) : PICK(closeListen);
  return ((ncclResult_t(*)(void *))f)(comm);
}

/* ---- data ------------------------------------------------------------------------------- */

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}
static void fill(unsigned char *p, size_t len, uint64_t seed) {
  uint64_t x = mix(seed + 1);
  for (size_t i = 0; i < len; i++) {
    if ((i & 7) == 0) x = mix(x + i);
    p[i] = (unsigned char)(x >> ((i & 7) * 8));
  }
}
static void verify(const unsigned char *p, size_t len, uint64_t seed, const char *what) {
  uint64_t x = mix(seed + 1);
  for (size_t i = 0; i < len; i++) {
    if ((i & 7) == 0) x = mix(x + i);
    if (p[i] != (unsigned char)(x >> ((i & 7) * 8)))
      FAIL("%s: byte %zu of %zu differs (message seed %llu)", what, i, len, (unsigned long long)seed);
  }
}

/* Seeds: distinct per sender rank, test and message. */
static uint64_t seed_of(int sender, int test, int msg) { return ((uint64_t)sender << 40) | ((uint64_t)test << 24) | msg; }

static unsigned char *sbuf, *rbuf;
static void *sc, *rc, *smh, *rmh;

/* Polls a request until done; returns the size `test` reported. */
static int wait_req(void *req, const char *what) {
  int done = 0, size = -1;
  double deadline = now() + 60;
  while (!done) {
    CHECK(n_test(req, &done, &size));
    if (!done) {
      if (now() > deadline) FAIL("%s: no completion within 60 s", what);
      sched_yield();
    }
  }
  return size;
}

static void *post_send(void *data, size_t size) {
  void *req = NULL;
  double deadline = now() + 60;
  while (!req) {
    CHECK(n_isend(sc, data, size, smh, &req));
    if (!req && now() > deadline) FAIL("isend never accepted");
  }
  return req;
}

static void *post_recv(void *data, size_t size, int preset_hint) {
  void *req = NULL;
  double deadline = now() + 60;
  while (!req) {
    req = preset_hint ? (void *)0x1 : NULL; /* NCCL >= 2.24 may store 0x1 (pitfall P6) */
    CHECK(n_irecv(rc, data, size, rmh, &req));
    if (req == (void *)0x1) FAIL("irecv left the 0x1 hint in *request");
    if (!req && now() > deadline) FAIL("irecv never accepted");
  }
  return req;
}

/* ---- connection setup ------------------------------------------------------------------- */

static void connect_pair(void) {
  char mine[NCCL_NET_HANDLE_MAXSIZE], theirs[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL;
  memset(mine, 0, sizeof mine);
  CHECK(n_listen(mine, &lc));
  if (!lc) FAIL("listen returned a NULL comm");
  oob_xchg(mine, theirs, sizeof mine);
  sc = rc = NULL;
  int rounds = 0;
  double deadline = now() + 30;
  while (!sc || !rc) {
    if (!sc) CHECK(n_connect(theirs, &sc));
    if (!rc) CHECK(n_accept(lc, &rc));
    rounds++;
    if (now() > deadline) FAIL("connect/accept not done after 30 s (%d rounds)", rounds);
    if (!sc || !rc) usleep(100);
  }
  CHECK(n_close(lc, 2));
  CHECK(n_regmr(sc, sbuf, REGION, &smh));
  CHECK(n_regmr(rc, rbuf, REGION, &rmh));
  if (!smh || !rmh) FAIL("regMr returned a NULL handle");
  printf("%s: connected in both directions after %d connect/accept rounds\n", vname, rounds);
}

/* GDR-probe style: listen, connect and accept from one thread of one process. */
static void loopback(void) {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL, *s = NULL, *r = NULL;
  CHECK(n_listen(handle, &lc));
  double deadline = now() + 30;
  while (!s || !r) {
    if (!s) CHECK(n_connect(handle, &s));
    if (!r) CHECK(n_accept(lc, &r));
    if (now() > deadline) FAIL("loopback connect/accept not done after 30 s");
    if (!s || !r) usleep(100);
  }
  void *mh1, *mh2;
  CHECK(n_regmr(s, sbuf, 4096, &mh1));
  CHECK(n_regmr(r, rbuf, 4096, &mh2));
  CHECK(n_deregmr(r, mh2));
  CHECK(n_deregmr(s, mh1));
  CHECK(n_close(r, 1));
  CHECK(n_close(s, 0));
  CHECK(n_close(lc, 2));
  /* A listen comm that never accepts must close cleanly too. */
  CHECK(n_listen(handle, &lc));
  CHECK(n_close(lc, 2));
  printf("%s: loopback listen/connect/accept from one thread ok\n", vname);
}

/* ---- scenarios -------------------------------------------------------------------------- */

/* Size of message `i` of a proxy-pattern run: runs of 0 bytes, else random up to a slot. */
static size_t proxy_size(int sender, int test_id, int i) {
  return (i % 17) < 3 ? 0 : mix(seed_of(sender, test_id, i)) % (SLOT + 1);
}

/* NCCL's proxy: STEPS slots per direction, receives of the full slot size, sends of random
 * sizes (runs of 0 bytes included), only the oldest request of each direction tested. */
static void proxy_pattern(int test_id, int messages) {
  void *sreq[STEPS] = {0}, *rreq[STEPS] = {0};
  size_t ssize[STEPS] = {0};
  int sent_posted = 0, sent_done = 0, recv_posted = 0, recv_done = 0;
  double deadline = now() + 120;
  while (sent_done < messages || recv_done < messages) {
    if (now() > deadline) FAIL("proxy pattern stuck: sent %d/%d received %d/%d", sent_done, messages, recv_done, messages);
    if (sent_posted < messages && sent_posted - sent_done < STEPS) {
      int k = sent_posted % STEPS;
      size_t size = proxy_size(rank, test_id, sent_posted);
      unsigned char *slot = sbuf + (size_t)k * SLOT;
      fill(slot, size, seed_of(rank, test_id, sent_posted));
      void *req = NULL;
      CHECK(n_isend(sc, slot, size, smh, &req));
      if (req) {
        sreq[k] = req;
        ssize[k] = size;
        sent_posted++;
      }
    }
    if (recv_posted < messages && recv_posted - recv_done < STEPS) {
      int k = recv_posted % STEPS;
      void *req = (recv_posted & 1) ? (void *)0x1 : NULL;
      CHECK(n_irecv(rc, rbuf + (size_t)k * SLOT, SLOT, rmh, &req));
      if (req == (void *)0x1) FAIL("irecv left the 0x1 hint in *request");
      if (req) rreq[k] = req, recv_posted++;
    }
    if (sent_done < sent_posted) {
      int k = sent_done % STEPS, done = 0, size = -1;
      CHECK(n_test(sreq[k], &done, &size));
      if (done) {
        if ((size_t)size != ssize[k]) FAIL("send %d: test reported %d bytes, sent %zu", sent_done, size, ssize[k]);
        sent_done++;
      }
    }
    if (recv_done < recv_posted) {
      int k = recv_done % STEPS, done = 0, size = -1;
      CHECK(n_test(rreq[k], &done, &size));
      if (done) {
        size_t want = proxy_size(1 - rank, test_id, recv_done);
        if ((size_t)size != want) FAIL("receive %d: test reported %d bytes, the peer sent %zu", recv_done, size, want);
        verify(rbuf + (size_t)k * SLOT, size, seed_of(1 - rank, test_id, recv_done), "proxy pattern");
        recv_done++;
      }
    }
    sched_yield();
  }
  printf("%s: proxy pattern: %d messages each way (0 B to 512 KiB, 8 in flight) verified\n", vname, messages);
}

/* The peer's expected sizes must match exactly: both ranks use the same size rule. */
static size_t burst_size(int i) {
  static const size_t sizes[] = {0, 1, 7, 4096, 16384, 16385, 65535, 65536, 65537, 300000, SLOT};
  return sizes[i % (sizeof sizes / sizeof sizes[0])];
}

/* 32 messages in flight each way; sends posted first (held until the receives exist) or
 * receives posted first. */
static void burst(int test_id, int sends_first) {
  void *sreq[NCCL_NET_MAX_REQUESTS], *rreq[NCCL_NET_MAX_REQUESTS];
  int n = NCCL_NET_MAX_REQUESTS;
  for (int phase = 0; phase < 2; phase++) {
    if ((phase == 0) == (sends_first != 0)) {
      for (int i = 0; i < n; i++) {
        unsigned char *slot = sbuf + (size_t)i * SLOT;
        fill(slot, burst_size(i), seed_of(rank, test_id, i));
        sreq[i] = post_send(slot, burst_size(i));
      }
    } else {
      for (int i = 0; i < n; i++) rreq[i] = post_recv(rbuf + (size_t)i * SLOT, SLOT, i & 1);
    }
    barrier();
    if (phase == 0) usleep(50000); /* the first half sits outstanding for a while */
  }
  for (int i = 0; i < n; i++) {
    int size = wait_req(rreq[i], "burst receive");
    if ((size_t)size != burst_size(i)) FAIL("burst: receive %d reported %d bytes, expected %zu", i, size, burst_size(i));
    verify(rbuf + (size_t)i * SLOT, size, seed_of(1 - rank, test_id, i), "burst");
  }
  for (int i = 0; i < n; i++) {
    int size = wait_req(sreq[i], "burst send");
    if ((size_t)size != burst_size(i)) FAIL("burst: send %d reported %d bytes", i, size);
  }
  barrier();
  printf("%s: 32 in flight each way, %s first, verified\n", vname, sends_first ? "sends" : "receives");
}

/* Size of message `i` of a flood: small (up to 16 KiB, so eager), runs of 0 bytes. */
static size_t flood_size(int sender, int test_id, int i) {
  return (i % 13) < 2 ? 0 : mix(seed_of(sender, test_id, i)) % (16 * 1024 + 1);
}

/* Many more small messages than a receiver can buffer, sent one after the other (each send
 * tested until done before the next) while the peer posts no receive for 100 ms, then receives
 * them 8 at a time: the sender must stall (flow control), never fail or overrun the receiver,
 * and everything must arrive in order once receives are posted. */
static void flood(int test_id) {
  enum { N = 300, BUFS = 64 };
  void *sreq = NULL, *rreq[STEPS] = {0};
  int sent_posted = 0, sent_done = 0, recv_posted = 0, recv_done = 0, sent_before_recv = -1;
  double start = now(), deadline = now() + 60;
  while (sent_done < N || recv_done < N) {
    if (now() > deadline) FAIL("flood stuck: sent %d/%d received %d/%d", sent_done, N, recv_done, N);
    if (!sreq && sent_posted < N) {
      size_t size = flood_size(rank, test_id, sent_posted);
      unsigned char *buf = sbuf + (size_t)(sent_posted % BUFS) * (32 * 1024);
      fill(buf, size, seed_of(rank, test_id, sent_posted));
      CHECK(n_isend(sc, buf, size, smh, &sreq));
      if (sreq) sent_posted++;
    }
    if (sreq) {
      int done = 0, size = -1;
      CHECK(n_test(sreq, &done, &size));
      if (done) {
        if ((size_t)size != flood_size(rank, test_id, sent_done)) FAIL("flood: send %d reported %d bytes", sent_done, size);
        sreq = NULL, sent_done++;
      }
    }
    if (now() - start < 0.1) {
      sched_yield();
      continue;
    }
    if (sent_before_recv < 0) sent_before_recv = sent_done;
    if (recv_posted < N && recv_posted - recv_done < STEPS) {
      int k = recv_posted % STEPS;
      void *req = NULL;
      CHECK(n_irecv(rc, rbuf + (size_t)k * SLOT, SLOT, rmh, &req));
      if (req) rreq[k] = req, recv_posted++;
    }
    if (recv_done < recv_posted) {
      int k = recv_done % STEPS, done = 0, size = -1;
      CHECK(n_test(rreq[k], &done, &size));
      if (done) {
        size_t want = flood_size(1 - rank, test_id, recv_done);
        if ((size_t)size != want) FAIL("flood: receive %d reported %d bytes, the peer sent %zu", recv_done, size, want);
        verify(rbuf + (size_t)k * SLOT, size, seed_of(1 - rank, test_id, recv_done), "flood");
        recv_done++;
      }
    }
    sched_yield();
  }
  if (sent_before_recv <= 0 || sent_before_recv >= N)
    FAIL("flood: %d of %d sends completed before any receive was posted: no flow control?", sent_before_recv, N);
  barrier();
  printf("%s: flood: %d small messages each way, %d sent before the first receive, verified\n", vname, N, sent_before_recv);
}

/* One message at a time, 0 B to 8 MiB, into a receive of 8 MiB. */
static void sizes(int test_id) {
  static const size_t list[] = {0, 1, 2, 63, 4096, 16383, 16384, 16385, 65471, 65536, 65537, 1 << 20, 8 * MIB - 1, 8 * MIB};
  int n = sizeof list / sizeof list[0];
  for (int i = 0; i < n; i++) {
    fill(sbuf, list[i], seed_of(rank, test_id, i));
    void *r = post_recv(rbuf, 8 * MIB, 0);
    void *s = post_send(sbuf, list[i]);
    int got = wait_req(r, "sizes receive");
    if ((size_t)got != list[i]) FAIL("sizes: received %d bytes, expected %zu", got, list[i]);
    verify(rbuf, got, seed_of(1 - rank, test_id, i), "sizes");
    if ((size_t)wait_req(s, "sizes send") != list[i]) FAIL("sizes: send size");
  }
  barrier();
  printf("%s: sizes 0 B to 8 MiB verified\n", vname);
}

/* Posts a receive of `capacity` bytes and a send of `size` into it; waits until the receive
 * fails (it must: the message does not fit) and the send finishes. Returns the send's result:
 * ncclSuccess if the message went eagerly (the sender cannot know the receive was too small:
 * only the receiver can tell, as with NCCL's own socket transport), ncclInvalidUsage if it went
 * by rendezvous (the sender saw the capacity in the clear-to-send). */
static ncclResult_t send_too_large(size_t capacity, size_t size) {
  void *r = post_recv(rbuf, capacity, 0);
  void *s = post_send(sbuf, size);
  int rcode = 0, rdone = 0, sdone = 0, done, got;
  ncclResult_t scode = ncclSuccess;
  double deadline = now() + 30;
  while (!rdone || !sdone) {
    if (!rdone) {
      ncclResult_t x = n_test(r, &done, &got);
      if (x != ncclSuccess) rcode = x, rdone = 1;
      else if (done) FAIL("too large (%zu into %zu): the receive completed (%d bytes)", size, capacity, got);
    }
    if (!sdone) {
      ncclResult_t x = n_test(s, &done, &got);
      if (x != ncclSuccess) scode = x, sdone = 1;
      else if (done) {
        if ((size_t)got != size) FAIL("too large: the send reported %d bytes, sent %zu", got, size);
        sdone = 1;
      }
    }
    if (now() > deadline) FAIL("too large (%zu into %zu): no outcome within 30 s", size, capacity);
    sched_yield();
  }
  if (rcode != ncclInvalidUsage) FAIL("too large (%zu into %zu): the receive returned %d; expected %d", size, capacity, rcode, ncclInvalidUsage);
  return scode;
}

/* A send larger than the posted receive: the receive fails with ncclInvalidUsage. A small
 * message goes eagerly, so its send completes; a large one goes by rendezvous, whose send
 * fails with ncclInvalidUsage too. Either way the connection carries the next message. */
static void too_large(int test_id) {
  ncclResult_t eager = send_too_large(1000, 2000);
  if (eager != ncclSuccess) FAIL("too large, eager: the send returned %d; expected success", eager);
  ncclResult_t rendezvous = send_too_large(1000, 100000);
  if (rendezvous != ncclInvalidUsage) FAIL("too large, rendezvous: the send returned %d; expected %d", rendezvous, ncclInvalidUsage);
  fill(sbuf, 5000, seed_of(rank, test_id, 1));
  void *r = post_recv(rbuf, 8192, 0);
  void *s = post_send(sbuf, 5000);
  if (wait_req(r, "after too large") != 5000) FAIL("after too large: size");
  verify(rbuf, 5000, seed_of(1 - rank, test_id, 1), "after too large");
  wait_req(s, "after too large send");
  barrier();
  printf("%s: a send larger than the receive fails the receive with ncclInvalidUsage (eager: the send completes; rendezvous: it fails too); the next message arrives\n", vname);
}

static void properties(void) {
  int ndev = 0;
  CHECK(n_devices(&ndev));
  if (ndev != 1) FAIL("devices: %d, expected 1", ndev);
  const char *name;
  int ptr, speed, maxrecvs, dtype;
  size_t maxp2p = 1;
  if (version == 8) {
    ncclNetProperties_v8_t p;
    memset(&p, 0xa5, sizeof p);
    CHECK(T8->getProperties(0, &p));
    name = p.name, ptr = p.ptrSupport, speed = p.speed, maxrecvs = p.maxRecvs, dtype = p.netDeviceType;
    if (T8->getProperties(1, &p) == ncclSuccess) FAIL("getProperties(1) succeeded");
  } else if (version == 11) {
    ncclNetProperties_v11_t p;
    memset(&p, 0xa5, sizeof p);
    CHECK(T11->getProperties(0, &p));
    name = p.name, ptr = p.ptrSupport, speed = p.speed, maxrecvs = p.maxRecvs, dtype = p.netDeviceType;
    maxp2p = p.maxP2pBytes;
    if (p.maxMultiRequestSize != 1 || p.vProps.ndevs != 1 || p.maxCollBytes == 0) FAIL("v11 properties");
  } else {
    ncclNetProperties_v9_t p;
    memset(&p, 0xa5, sizeof p);
    CHECK(((ncclResult_t(*)(int, ncclNetProperties_v9_t *))PICK(getProperties))(0, &p));
    name = p.name, ptr = p.ptrSupport, speed = p.speed, maxrecvs = p.maxRecvs, dtype = p.netDeviceType;
    maxp2p = p.maxP2pBytes;
    if (p.forceFlush != 0 || p.vProps.ndevs != 1 || p.vProps.devs[0] != 0 || p.maxCollBytes == 0) FAIL("v9 properties");
  }
  if (strcmp(name, "tbrdma0") || ptr != NCCL_PTR_HOST || speed <= 0 || maxrecvs != 1 || dtype != 0 || maxp2p == 0)
    FAIL("properties: name %s ptrSupport %d speed %d maxRecvs %d type %d maxP2pBytes %zu", name, ptr, speed, maxrecvs, dtype, maxp2p);
  printf("%s: 1 device, %s, host memory, %d Mbit/s\n", vname, name, speed);
}

static void run_version(void *lib, int v) {
  static char label[8];
  char sym[32];
  version = v;
  snprintf(label, sizeof label, "v%d", v);
  vname = label;
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
  table = dlsym(lib, sym);
  if (!table) FAIL("%s not found", sym);
  if (strcmp(*(const char **)table, "tbrdma")) FAIL("plugin name %s", *(const char **)table);
  CHECK(n_init());
  void *first_ctx = ctx11;
  CHECK(n_init()); /* a second init (v11: a second communicator) */
  if (version == 11 && (first_ctx == ctx11 || !ctx11)) FAIL("v11 init: contexts must differ");
  properties();
  loopback();
  connect_pair();
  int base = v * 10;
  proxy_pattern(base + 1, 300);
  burst(base + 2, 1);
  burst(base + 3, 0);
  sizes(base + 4);
  too_large(base + 5);
  flood(base + 6);
  CHECK(n_deregmr(sc, smh));
  CHECK(n_deregmr(rc, rmh));
  if (n_deregmr(rc, rmh) == ncclSuccess) FAIL("deregMr twice succeeded");
  CHECK(n_close(sc, 0));
  CHECK(n_close(rc, 1));
  if (n_close(sc, 0) == ncclSuccess) FAIL("closeSend twice succeeded");
  if (version == 11) {
    CHECK(T11->finalize(first_ctx));
    CHECK(T11->finalize(ctx11));
    if (T11->finalize(ctx11) == ncclSuccess) FAIL("finalize twice succeeded");
  }
  barrier();
  printf("%s: all scenarios passed\n", vname);
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: harness DIR RANK PEER_IP OOB_PORT VERSIONS\n");
    return 2;
  }
  rank = atoi(argv[2]);
  alarm(600); /* a hang is a failure, never a stuck CI */
  sbuf = aligned_alloc(4096, REGION);
  rbuf = aligned_alloc(4096, REGION);
  if (!sbuf || !rbuf) FAIL("out of memory");
  memset(rbuf, 0, REGION);

  /* Both installed names load, and each exports every version as a data object. */
  const char *names[] = {"libnccl-net-tbrdma.so", "librccl-net-tbrdma.so"};
  void *lib = NULL;
  for (int i = 0; i < 2; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", argv[1], names[i]);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) FAIL("dlopen %s: %s", path, dlerror());
    for (int v = 8; v <= 11; v++) {
      char sym[32];
      snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
      if (!dlsym(h, sym)) FAIL("%s: %s missing", names[i], sym);
    }
    if (dlsym(h, "ncclCollNetPlugin_v8") || dlsym(h, "ncclNetPlugin_v12")) FAIL("%s exports more than it should", names[i]);
    if (i == 0) lib = h;
    else dlclose(h);
  }
  printf("both names load; v8, v9, v10 and v11 resolve\n");

  oob_setup(argv[3], atoi(argv[4]));
  char *list = strdup(argv[5]);
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) run_version(lib, atoi(tok));
  if (!logged_init) FAIL("the plugin never logged through NCCL's logger");

  /* NCCL may dlclose the plugin after the last communicator and dlopen it again. */
  dlclose(lib);
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", argv[1], names[0]);
  lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) FAIL("dlopen again: %s", dlerror());
  version = 10;
  table = dlsym(lib, "ncclNetPlugin_v10");
  vname = "reload";
  CHECK(n_init());
  connect_pair();
  sizes(99);
  CHECK(n_close(sc, 0));
  CHECK(n_close(rc, 1));
  barrier();
  printf("reload: dlclose, dlopen, init, transfer ok\n");
  printf("harness: all checks passed\n");
  return 0;
}

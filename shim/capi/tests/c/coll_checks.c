/* Checks of the collectives' C API, run by tests/collectives.rs.
 *
 *   coll_checks local HOSTFILE          a one-rank hostfile: every argument error (code and
 *                                       message) and the semantics on one rank (in place,
 *                                       overlapping buffers, the reduce-scatter split); no
 *                                       second host, no root needed
 *   coll_checks failure HOSTFILE RANK   two ranks: rank 1 leaves after a barrier, and rank 0's
 *                                       next collectives must fail naming it */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tbrdma.h"

static int checks;

/* `rc` must be `want` and, for an error, the last message must contain `needle`. */
static void expect(int rc, int want, const char *needle, const char *what) {
  const char *msg = rc == TBRDMA_OK ? "" : tbrdma_last_error();
  if (rc != want || (needle && !strstr(msg, needle))) {
    fprintf(stderr, "FAIL %s: returned %d (expected %d), message \"%s\" (expected to contain \"%s\")\n", what, rc,
            want, msg, needle ? needle : "");
    exit(1);
  }
  checks++;
  if (rc != TBRDMA_OK) printf("ok %s: %s\n", what, msg);
}
#define OK(call) expect((call), TBRDMA_OK, NULL, #call)

static void same(const void *a, const void *b, size_t n, const char *what) {
  if (memcmp(a, b, n)) {
    fprintf(stderr, "FAIL %s: wrong data\n", what);
    exit(1);
  }
  checks++;
}

static int local(const char *hostfile) {
  tbrdma_comm *comm = (tbrdma_comm *)1;
  tbrdma_comm_options opts;
  const int E = TBRDMA_ERR_INVALID;

  /* Construction. */
  expect(tbrdma_comm_options_init(NULL), E, "opts is NULL", "options_init(NULL)");
  OK(tbrdma_comm_options_init(&opts));
  if (opts.timeout_ms != 20000 || opts.slots != 8 || opts.algorithm != TBRDMA_ALGO_AUTO) {
    fprintf(stderr, "FAIL: unexpected defaults\n");
    return 1;
  }
  expect(tbrdma_comm_from_hostfile(NULL, 0, NULL, &comm), E, "tbrdma_comm_from_hostfile: hostfile is NULL",
         "NULL hostfile");
  if (comm != NULL) {
    fprintf(stderr, "FAIL: *out is not NULL after a failure\n");
    return 1;
  }
  expect(tbrdma_comm_from_hostfile(hostfile, 0, NULL, NULL), E, "out is NULL", "NULL out");
  expect(tbrdma_comm_from_hostfile("/nonexistent/hostfile", 0, NULL, &comm), E, "/nonexistent/hostfile",
         "missing hostfile");
  expect(tbrdma_comm_from_hostfile(hostfile, 1, NULL, &comm), E, "rank 1 is not in the hostfile", "rank too high");
  expect(tbrdma_comm_from_hostfile(hostfile, -1, NULL, &comm), E, "rank -1 is negative", "negative rank");
  tbrdma_comm_options bad = opts;
  bad.algorithm = 7;
  expect(tbrdma_comm_from_hostfile(hostfile, 0, &bad, &comm), E, "algorithm 7", "bad algorithm");
  bad = opts;
  bad.engine = 9;
  expect(tbrdma_comm_from_hostfile(hostfile, 0, &bad, &comm), E, "engine 9", "bad engine");
  bad = opts;
  bad.timeout_ms = 0;
  expect(tbrdma_comm_from_hostfile(hostfile, 0, &bad, &comm), E, "timeout_ms is 0", "zero timeout");
  bad = opts;
  bad.slots = 1;
  expect(tbrdma_comm_from_hostfile(hostfile, 0, &bad, &comm), E, "1 slots", "one slot");
  unsetenv("TBRDMA_HOSTFILE");
  unsetenv("TBRDMA_ADDR");
  unsetenv("TBRDMA_RANK");
  unsetenv("TBRDMA_WORLD_SIZE");
  expect(tbrdma_comm_from_env(NULL, &comm), E, "TBRDMA_RANK is not set", "empty environment");
  setenv("TBRDMA_RANK", "0", 1);
  expect(tbrdma_comm_from_env(NULL, &comm), E, "neither TBRDMA_HOSTFILE nor TBRDMA_ADDR", "no hostfile or address");
  expect(tbrdma_comm_from_rendezvous("nonsense", 0, 2, NULL, &comm), E, "is not \"ip:port\"", "bad address");
  expect(tbrdma_comm_from_rendezvous("127.0.0.1:1", 2, 2, NULL, &comm), E, "rank 2 is not below world_size 2",
         "rendezvous rank too high");
  setenv("TBRDMA_HOSTFILE", hostfile, 1);
  OK(tbrdma_comm_from_env(NULL, &comm));
  tbrdma_comm_free(comm);
  tbrdma_comm_free(NULL);
  OK(tbrdma_comm_from_hostfile(hostfile, 0, &opts, &comm));
  if (tbrdma_comm_rank(comm) != 0 || tbrdma_comm_world_size(comm) != 1) {
    fprintf(stderr, "FAIL: rank/world size\n");
    return 1;
  }
  expect(tbrdma_comm_rank(NULL), E, "tbrdma_comm_rank: comm is NULL", "rank of NULL");
  expect(tbrdma_comm_world_size(NULL), E, "comm is NULL", "world size of NULL");
  if (tbrdma_dtype_size(TBRDMA_DTYPE_F32) != 4 || tbrdma_dtype_size(TBRDMA_DTYPE_BF16) != 2 ||
      tbrdma_dtype_size(TBRDMA_DTYPE_I64) != 8 || tbrdma_dtype_size(TBRDMA_DTYPE_U8) != 1 || tbrdma_dtype_size(8) != 0) {
    fprintf(stderr, "FAIL: tbrdma_dtype_size\n");
    return 1;
  }

  /* Argument errors of the collectives. */
  float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {0}, keep[8];
  memcpy(keep, a, sizeof a);
  const int F32 = TBRDMA_DTYPE_F32, SUM = TBRDMA_REDOP_SUM;
  expect(tbrdma_all_reduce(NULL, a, b, 8, F32, SUM), E, "tbrdma_all_reduce: comm is NULL", "NULL comm");
  expect(tbrdma_all_reduce(comm, a, b, 8, 8, SUM), E, "dtype 8 is not a tbrdma_dtype", "dtype 8");
  expect(tbrdma_all_reduce(comm, a, b, 8, -1, SUM), E, "dtype -1", "dtype -1");
  expect(tbrdma_all_reduce(comm, a, b, 8, F32, 5), E, "op 5 is not a tbrdma_redop", "op 5");
  expect(tbrdma_all_reduce(comm, a, b, SIZE_MAX / 4 + 1, F32, SUM), E, "overflows", "count * 4 wraps");
  expect(tbrdma_all_reduce(comm, a, b, SIZE_MAX / 8 + 1, F32, SUM), E, "overflows", "count beyond PTRDIFF_MAX");
  expect(tbrdma_all_reduce(comm, NULL, b, 8, F32, SUM), E, "sendbuf is NULL", "NULL sendbuf");
  expect(tbrdma_all_reduce(comm, a, NULL, 8, F32, SUM), E, "recvbuf is NULL", "NULL recvbuf");
  OK(tbrdma_all_reduce(comm, NULL, NULL, 0, F32, SUM));
  size_t off = 99, len = 99;
  expect(tbrdma_reduce_scatter_range(comm, 10, 1, &off, &len), E, "rank 1 is not a rank", "range of rank 1");
  expect(tbrdma_reduce_scatter_range(comm, 10, -1, &off, &len), E, "rank -1 is negative", "range of rank -1");
  OK(tbrdma_reduce_scatter_range(comm, 10, 0, &off, &len));
  OK(tbrdma_reduce_scatter_range(comm, 10, 0, NULL, NULL));
  if (off != 0 || len != 10) {
    fprintf(stderr, "FAIL: range %zu+%zu\n", off, len);
    return 1;
  }
  expect(tbrdma_reduce_scatter(comm, a, b, 8, 7, F32, SUM), E, "recvcount is 7, but rank 0 receives 8 of 8",
         "reduce_scatter output too short");
  expect(tbrdma_reduce_scatter(comm, a, b, 8, 8, F32, 17), E, "op 17", "reduce_scatter op 17");
  expect(tbrdma_all_gather(comm, a, NULL, 8, F32), E, "recvbuf is NULL", "all_gather NULL recvbuf");
  expect(tbrdma_all_gather(comm, a, b, SIZE_MAX / 2, TBRDMA_DTYPE_I64), E, "overflows", "all_gather overflow");
  expect(tbrdma_broadcast(comm, a, 8, F32, 1), E, "root 1 is not a rank", "broadcast root 1");
  expect(tbrdma_broadcast(comm, a, 8, F32, -2), E, "root -2 is negative", "broadcast root -2");
  expect(tbrdma_broadcast(comm, NULL, 8, F32, 0), E, "buf is NULL", "broadcast NULL buf");
  expect(tbrdma_reduce(comm, a, NULL, 8, F32, SUM, 0), E, "recvbuf is NULL", "reduce NULL recvbuf on the root");
  expect(tbrdma_reduce(comm, a, b, 8, F32, SUM, 3), E, "root 3 is not a rank", "reduce root 3");
  expect(tbrdma_send(comm, a, 8, F32, 0), E, "no path from rank 0 to rank 0", "send to self");
  expect(tbrdma_recv(comm, b, 8, F32, -1), E, "peer -1 is negative", "recv from -1");
  expect(tbrdma_forward(comm, 0, 0, 8, F32), E, "no path", "forward to self");
  int path[4];
  expect(tbrdma_route(comm, 0, 0, path, 4), E, "no path", "route to self");
  expect(tbrdma_route(comm, 0, 1, NULL, 4), E, "path is NULL", "route into NULL");
  expect(tbrdma_barrier(NULL), E, "comm is NULL", "barrier NULL");

  /* One rank: every collective copies or leaves its data. */
  OK(tbrdma_all_reduce(comm, a, b, 8, F32, SUM));
  same(b, keep, sizeof b, "all_reduce out of place");
  OK(tbrdma_all_reduce(comm, a, a, 8, F32, TBRDMA_REDOP_AVG));
  same(a, keep, sizeof a, "all_reduce in place");
  /* Overlapping, not equal: the input is read as it was before any output is written. */
  OK(tbrdma_all_reduce(comm, a, a + 2, 6, F32, SUM));
  same(a + 2, keep, 6 * sizeof *a, "all_reduce on overlapping buffers");
  memcpy(a, keep, sizeof a);
  memset(b, 0, sizeof b);
  OK(tbrdma_reduce_scatter(comm, a, b, 8, 8, F32, SUM));
  same(b, keep, sizeof b, "reduce_scatter");
  OK(tbrdma_reduce_scatter(comm, a, a, 8, 8, F32, TBRDMA_REDOP_MAX));
  same(a, keep, sizeof a, "reduce_scatter in place");
  memset(b, 0, sizeof b);
  OK(tbrdma_all_gather(comm, a, b, 8, F32));
  same(b, keep, sizeof b, "all_gather");
  OK(tbrdma_all_gather(comm, a, a, 8, F32));
  same(a, keep, sizeof a, "all_gather in place");
  OK(tbrdma_broadcast(comm, a, 8, F32, 0));
  same(a, keep, sizeof a, "broadcast");
  memset(b, 0, sizeof b);
  OK(tbrdma_reduce(comm, a, b, 8, F32, TBRDMA_REDOP_PROD, 0));
  same(b, keep, sizeof b, "reduce");
  OK(tbrdma_reduce(comm, a, a, 8, F32, SUM, 0));
  same(a, keep, sizeof a, "reduce in place");
  OK(tbrdma_barrier(comm));
  tbrdma_comm_free(comm);
  printf("local: %d checks passed\n", checks);
  return 0;
}

static int failure(const char *hostfile, int rank) {
  tbrdma_comm_options opts;
  tbrdma_comm *comm;
  OK(tbrdma_comm_options_init(&opts));
  opts.timeout_ms = 4000;
  OK(tbrdma_comm_from_hostfile(hostfile, rank, &opts, &comm));
  OK(tbrdma_barrier(comm));
  if (rank == 1) {
    tbrdma_comm_free(comm);
    printf("rank 1: left\n");
    return 0;
  }
  float x[1000] = {0};
  int rc = tbrdma_all_reduce(comm, x, x, 1000, TBRDMA_DTYPE_F32, TBRDMA_REDOP_SUM);
  if (rc != TBRDMA_ERR_RANK_FAILED || !strstr(tbrdma_last_error(), "rank 1 failed")) {
    fprintf(stderr, "FAIL: all_reduce without rank 1 returned %d: %s\n", rc, tbrdma_last_error());
    return 1;
  }
  printf("rank 0: all_reduce failed (%d): %s\n", rc, tbrdma_last_error());
  expect(tbrdma_barrier(comm), TBRDMA_ERR_RANK_FAILED, "unusable", "barrier after the failure");
  tbrdma_comm_free(comm);
  printf("rank 0: failure of rank 1 reported\n");
  return 0;
}

int main(int argc, char **argv) {
  alarm(60);
  if (argc == 3 && !strcmp(argv[1], "local")) return local(argv[2]);
  if (argc == 4 && !strcmp(argv[1], "failure")) return failure(argv[2], atoi(argv[3]));
  fprintf(stderr, "usage: %s local HOSTFILE | failure HOSTFILE RANK\n", argv[0]);
  return 2;
}

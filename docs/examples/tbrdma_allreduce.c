/* Collectives across the ranks of a hostfile with libtbrdma (tbrdma.h).
 *
 *   every rank: tbrdma_allreduce HOSTFILE RANK
 *          or:  tbrdma_allreduce              (TBRDMA_HOSTFILE and TBRDMA_RANK, as `tbrdma lab exec`
 *                                              sets them; or TBRDMA_ADDR, TBRDMA_RANK and
 *                                              TBRDMA_WORLD_SIZE for a rendezvous at rank 0)
 *
 * Each rank builds a communicator, then runs, checking every result against what it computes
 * locally: an all-reduce (f32 sum, out of place, 280 KB: the ring algorithm under the default
 * options), an in-place all-reduce (i32 max: one-shot on a pair or mesh), a reduce-scatter with
 * a count that does not divide by the world size, an all-gather, a reduce to rank 0, a
 * broadcast from the last rank, a message from rank 0 to rank world / 2 (relayed by the ranks in
 * between where no cable joins them), and a barrier. The inputs are small integers, exact in
 * every type and every reduction order.
 *
 * Build: cc -o tbrdma_allreduce tbrdma_allreduce.c -I shim/capi/include -L target/release -ltbrdma */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tbrdma.h"

#define COUNT 70000 /* f32 elements of the big all-reduce */

static int rank, world;

static void die(const char *what, int code) {
  fprintf(stderr, "rank %d: %s failed (%d): %s\n", rank, what, code, tbrdma_last_error());
  exit(1);
}
#define TRY(call) do { int rc_ = (call); if (rc_ != TBRDMA_OK) die(#call, rc_); } while (0)

static void wrong(const char *what, size_t i, double got, double want) {
  fprintf(stderr, "rank %d: %s: element %zu is %g, expected %g\n", rank, what, i, got, want);
  exit(1);
}

int main(int argc, char **argv) {
  alarm(60); /* never hang: a lost rank ends the program */
  tbrdma_comm_options opts;
  TRY(tbrdma_comm_options_init(&opts));
  opts.timeout_ms = 10000;
  tbrdma_comm *comm;
  if (argc == 3)
    TRY(tbrdma_comm_from_hostfile(argv[1], atoi(argv[2]), &opts, &comm));
  else if (argc == 1)
    TRY(tbrdma_comm_from_env(&opts, &comm));
  else {
    fprintf(stderr, "usage: %s [HOSTFILE RANK]\n", argv[0]);
    return 2;
  }
  rank = tbrdma_comm_rank(comm);
  world = tbrdma_comm_world_size(comm);
  printf("rank %d: communicator of %d ranks\n", rank, world);
  fflush(stdout);
  const int tri = world * (world + 1) / 2; /* 1 + 2 + ... + world */

  /* All-reduce, out of place: rank r contributes (r + 1) * (i % 7 + 1). */
  float *in = malloc(COUNT * sizeof *in), *out = malloc(COUNT * sizeof *out);
  if (!in || !out) die("malloc", -1);
  for (size_t i = 0; i < COUNT; i++) in[i] = (float)((rank + 1) * (int)(i % 7 + 1));
  TRY(tbrdma_all_reduce(comm, in, out, COUNT, TBRDMA_DTYPE_F32, TBRDMA_REDOP_SUM));
  for (size_t i = 0; i < COUNT; i++)
    if (out[i] != (float)(tri * (int)(i % 7 + 1))) wrong("all_reduce", i, out[i], tri * (int)(i % 7 + 1));
  printf("rank %d: all_reduce of %d f32 (sum) verified\n", rank, COUNT);

  /* All-reduce in place (sendbuf == recvbuf): the maximum of rank * 10 + i. */
  int32_t v[5];
  for (int i = 0; i < 5; i++) v[i] = rank * 10 + i;
  TRY(tbrdma_all_reduce(comm, v, v, 5, TBRDMA_DTYPE_I32, TBRDMA_REDOP_MAX));
  for (int i = 0; i < 5; i++)
    if (v[i] != (world - 1) * 10 + i) wrong("in-place all_reduce", (size_t)i, v[i], (world - 1) * 10 + i);
  printf("rank %d: in-place all_reduce (max) verified\n", rank);

  /* Reduce-scatter of 10 * world + 1 elements: rank r gets its part of the sums. */
  size_t rs_count = 10 * (size_t)world + 1, offset, mine;
  int64_t *rs_in = malloc(rs_count * sizeof *rs_in), *rs_out = malloc(rs_count * sizeof *rs_out);
  if (!rs_in || !rs_out) die("malloc", -1);
  TRY(tbrdma_reduce_scatter_range(comm, rs_count, rank, &offset, &mine));
  for (size_t i = 0; i < rs_count; i++) rs_in[i] = (int64_t)i * (rank + 1);
  TRY(tbrdma_reduce_scatter(comm, rs_in, rs_out, rs_count, mine, TBRDMA_DTYPE_I64, TBRDMA_REDOP_SUM));
  for (size_t i = 0; i < mine; i++)
    if (rs_out[i] != (int64_t)(offset + i) * tri) wrong("reduce_scatter", i, (double)rs_out[i], (double)(offset + i) * tri);
  printf("rank %d: reduce_scatter verified (elements %zu to %zu)\n", rank, offset, offset + mine - 1);

  /* All-gather: 3 values per rank; rank k's land at 3k. */
  int32_t mine3[3], *all = malloc(3 * (size_t)world * sizeof *all);
  if (!all) die("malloc", -1);
  for (int i = 0; i < 3; i++) mine3[i] = 100 * rank + i;
  TRY(tbrdma_all_gather(comm, mine3, all, 3, TBRDMA_DTYPE_I32));
  for (int k = 0; k < world; k++)
    for (int i = 0; i < 3; i++)
      if (all[3 * k + i] != 100 * k + i) wrong("all_gather", (size_t)(3 * k + i), all[3 * k + i], 100 * k + i);
  printf("rank %d: all_gather verified\n", rank);

  /* Reduce to rank 0 (the minimum); the others pass no output buffer. */
  double low[4], red[4];
  for (int i = 0; i < 4; i++) low[i] = 1000.0 - rank - i;
  TRY(tbrdma_reduce(comm, low, rank == 0 ? red : NULL, 4, TBRDMA_DTYPE_F64, TBRDMA_REDOP_MIN, 0));
  if (rank == 0)
    for (int i = 0; i < 4; i++)
      if (red[i] != 1000.0 - (world - 1) - i) wrong("reduce", (size_t)i, red[i], 1000.0 - (world - 1) - i);
  printf("rank %d: reduce verified\n", rank);

  /* Broadcast from the last rank. */
  const int root = world - 1;
  double b[1000];
  for (int i = 0; i < 1000; i++) b[i] = rank == root ? i * 0.5 : -1.0;
  TRY(tbrdma_broadcast(comm, b, 1000, TBRDMA_DTYPE_F64, root));
  for (int i = 0; i < 1000; i++)
    if (b[i] != i * 0.5) wrong("broadcast", (size_t)i, b[i], i * 0.5);
  printf("rank %d: broadcast from rank %d verified\n", rank, root);

  /* A message from rank 0 to rank world / 2: direct over a cable on a pair or mesh; on a ring
   * of 4 (no cable between 0 and 2) rank 1 relays it. */
  if (world > 1) {
    const int dst = world / 2;
    int path[16];
    int hops = tbrdma_route(comm, 0, dst, path, 16);
    if (hops < 0) die("tbrdma_route", hops);
    if (hops > 16) die("a route this long", hops);
    uint8_t msg[300];
    if (rank == 0) {
      for (int i = 0; i < 300; i++) msg[i] = (uint8_t)(i * 7);
      TRY(tbrdma_send(comm, msg, 300, TBRDMA_DTYPE_U8, dst));
    } else if (rank == dst) {
      TRY(tbrdma_recv(comm, msg, 300, TBRDMA_DTYPE_U8, 0));
      for (int i = 0; i < 300; i++)
        if (msg[i] != (uint8_t)(i * 7)) wrong("recv", (size_t)i, msg[i], (uint8_t)(i * 7));
      printf("rank %d: message from rank 0 over %d hops verified\n", rank, hops - 1);
    } else {
      for (int i = 1; i < hops - 1; i++)
        if (path[i] == rank) {
          TRY(tbrdma_forward(comm, 0, dst, 300, TBRDMA_DTYPE_U8));
          printf("rank %d: relayed the message from rank 0 to rank %d\n", rank, dst);
        }
    }
  }

  /* Errors come back as codes with a message, before anything is sent. */
  int rc = tbrdma_all_reduce(comm, in, out, COUNT, 42, TBRDMA_REDOP_SUM);
  if (rc != TBRDMA_ERR_INVALID || strlen(tbrdma_last_error()) == 0) die("the error path", rc);
  printf("rank %d: bad dtype refused: %s\n", rank, tbrdma_last_error());

  TRY(tbrdma_barrier(comm));
  tbrdma_comm_free(comm);
  free(in);
  free(out);
  free(rs_in);
  free(rs_out);
  free(all);
  printf("rank %d: all checks passed\n", rank);
  return 0;
}

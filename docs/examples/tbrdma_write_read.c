/* A WRITE and a READ between two hosts with libtbrdma (tbrdma.h).
 *
 *   server: tbrdma_write_read server LOCAL_IP PORT
 *   client: tbrdma_write_read client LOCAL_IP SERVER_IP:PORT
 *
 * The server registers 1 MiB (remote write and read allowed), fills its second half with a
 * known pattern, and sends the region's address and rkey as private data while accepting.
 * The client WRITEs 64 KiB of its own pattern into the first half, then a flag word; READs
 * 64 KiB of the server's pattern back; checks it; and writes a second flag. The server, whose
 * engine thread places the client's writes with no call from it, waits for the first flag,
 * checks the 64 KiB, then waits for the second flag before leaving.
 *
 * Build: cc -o tbrdma_write_read tbrdma_write_read.c -I shim/capi/include -L target/release -ltbrdma */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tbrdma.h"

#define REGION (1 << 20)
#define LEN (64 * 1024)
#define FLAG_AT (REGION / 2 - 8) /* last word of the first half */
#define PATTERN_AT (REGION / 2)

static int die(const char *what, int code) {
  fprintf(stderr, "%s failed (%d): %s\n", what, code, tbrdma_last_error());
  exit(1);
}
#define TRY(call) do { int rc_ = (call); if (rc_ != TBRDMA_OK) die(#call, rc_); } while (0)

static unsigned char byte_at(size_t i, unsigned seed) { return (unsigned char)((i * 131 + seed) ^ (i >> 9)); }

static void wait_one(tbrdma_cq *cq, const char *what) {
  tbrdma_wc wc;
  int n;
  while ((n = tbrdma_poll_cq(cq, &wc, 1)) == 0) {
  }
  if (n < 0) die("tbrdma_poll_cq", n);
  if (wc.status != TBRDMA_WC_SUCCESS) {
    fprintf(stderr, "%s completed with status %u\n", what, wc.status);
    exit(1);
  }
}

static uint64_t load_flag(const unsigned char *base) {
  return __atomic_load_n((const uint64_t *)(base + FLAG_AT), __ATOMIC_ACQUIRE);
}

static int server(const char *ip, uint16_t port) {
  tbrdma_device *dev;
  tbrdma_pd *pd;
  tbrdma_mr *mr;
  tbrdma_cq *cq;
  tbrdma_listener *l;
  tbrdma_qp *qp;
  TRY(tbrdma_device_open(ip, TBRDMA_ENGINE_URING, TBRDMA_PROGRESS_THREAD, &dev));
  TRY(tbrdma_pd_alloc(dev, &pd));
  TRY(tbrdma_mr_alloc(pd, REGION, TBRDMA_ACCESS_LOCAL_WRITE | TBRDMA_ACCESS_REMOTE_WRITE | TBRDMA_ACCESS_REMOTE_READ, &mr));
  unsigned char *base = tbrdma_mr_addr(mr);
  for (size_t i = 0; i < LEN; i++) base[PATTERN_AT + i] = byte_at(i, 2);
  TRY(tbrdma_cq_create(dev, 64, &cq));
  TRY(tbrdma_listen(dev, port, &l));
  unsigned char announce[12];
  uint64_t addr = (uint64_t)(uintptr_t)base;
  uint32_t rkey = tbrdma_mr_rkey(mr);
  memcpy(announce, &addr, 8);
  memcpy(announce + 8, &rkey, 4);
  printf("server: listening on %s:%u\n", ip, tbrdma_listener_port(l));
  fflush(stdout);
  TRY(tbrdma_accept(l, pd, cq, cq, announce, sizeof announce, 30000, &qp));
  while (load_flag(base) < 1) usleep(50); /* 1, or already 2 */
  for (size_t i = 0; i < LEN; i++)
    if (base[i] != byte_at(i, 1)) {
      fprintf(stderr, "server: byte %zu of the WRITE differs\n", i);
      return 1;
    }
  printf("server: WRITE of %d bytes arrived intact\n", LEN);
  while (load_flag(base) != 2) usleep(50);
  tbrdma_qp_free(qp);
  tbrdma_listener_free(l);
  tbrdma_cq_free(cq);
  tbrdma_mr_free(mr);
  tbrdma_pd_free(pd);
  tbrdma_device_close(dev);
  printf("server: done\n");
  return 0;
}

static int client(const char *ip, const char *server_addr) {
  tbrdma_device *dev;
  tbrdma_pd *pd;
  tbrdma_mr *mr;
  tbrdma_cq *cq;
  tbrdma_qp *qp = NULL;
  TRY(tbrdma_device_open(ip, TBRDMA_ENGINE_URING, TBRDMA_PROGRESS_CALLER, &dev));
  TRY(tbrdma_pd_alloc(dev, &pd));
  TRY(tbrdma_mr_alloc(pd, REGION, TBRDMA_ACCESS_LOCAL_WRITE, &mr));
  TRY(tbrdma_cq_create(dev, 64, &cq));
  /* The server may not listen yet: retry while nobody answers. */
  for (int i = 0;; i++) {
    int rc = tbrdma_connect(pd, server_addr, cq, cq, NULL, 0, 5000, &qp);
    if (rc == TBRDMA_OK) break;
    if (rc != TBRDMA_ERR_CONNECT || i == 200) die("tbrdma_connect", rc);
    usleep(50000);
  }
  unsigned char announce[12];
  if (tbrdma_qp_peer_private_data(qp, announce, sizeof announce) != sizeof announce) die("private data", -1);
  uint64_t raddr;
  uint32_t rkey;
  memcpy(&raddr, announce, 8);
  memcpy(&rkey, announce + 8, 4);

  unsigned char *base = tbrdma_mr_addr(mr);
  uint32_t lkey = tbrdma_mr_lkey(mr);
  for (size_t i = 0; i < LEN; i++) base[i] = byte_at(i, 1);
  uint64_t one = 1;
  memcpy(base + LEN, &one, 8);
  /* WRITE the data, then the flag: requests execute at the responder in post order. */
  tbrdma_send_wr w[2] = {
      {.wr_id = 1, .opcode = TBRDMA_WR_WRITE, .sge = {(uint64_t)(uintptr_t)base, LEN, lkey}, .remote_addr = raddr, .rkey = rkey},
      {.wr_id = 2, .opcode = TBRDMA_WR_WRITE, .sge = {(uint64_t)(uintptr_t)(base + LEN), 8, lkey}, .remote_addr = raddr + FLAG_AT, .rkey = rkey},
  };
  TRY(tbrdma_post_send(qp, w, 2));
  wait_one(cq, "WRITE");
  wait_one(cq, "flag WRITE");
  printf("client: WRITE of %d bytes completed\n", LEN);

  unsigned char *dst = base + 2 * LEN;
  tbrdma_send_wr r = {.wr_id = 3, .opcode = TBRDMA_WR_READ, .sge = {(uint64_t)(uintptr_t)dst, LEN, lkey}, .remote_addr = raddr + PATTERN_AT, .rkey = rkey};
  TRY(tbrdma_post_send(qp, &r, 1));
  wait_one(cq, "READ");
  for (size_t i = 0; i < LEN; i++)
    if (dst[i] != byte_at(i, 2)) {
      fprintf(stderr, "client: byte %zu of the READ differs\n", i);
      return 1;
    }
  printf("client: READ of %d bytes verified\n", LEN);

  uint64_t two = 2;
  memcpy(base + LEN, &two, 8);
  w[1].wr_id = 4;
  TRY(tbrdma_post_send(qp, &w[1], 1));
  wait_one(cq, "final flag WRITE");

  /* Errors come back as codes with a message. */
  tbrdma_mr *bad;
  int rc = tbrdma_mr_alloc(pd, REGION, 0xffff, &bad);
  if (rc != TBRDMA_ERR_INVALID || strlen(tbrdma_last_error()) == 0) die("the error path", rc);
  printf("client: bad access flags refused: %s\n", tbrdma_last_error());

  tbrdma_qp_free(qp);
  tbrdma_cq_free(cq);
  tbrdma_mr_free(mr);
  tbrdma_pd_free(pd);
  tbrdma_device_close(dev);
  printf("client: done\n");
  return 0;
}

int main(int argc, char **argv) {
  alarm(60); /* never hang: a lost peer ends the program */
  if (argc == 4 && !strcmp(argv[1], "server")) return server(argv[2], (uint16_t)atoi(argv[3]));
  if (argc == 4 && !strcmp(argv[1], "client")) return client(argv[2], argv[3]);
  fprintf(stderr, "usage: %s server LOCAL_IP PORT | client LOCAL_IP SERVER_IP:PORT\n", argv[0]);
  return 2;
}

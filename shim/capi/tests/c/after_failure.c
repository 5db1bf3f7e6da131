/* A C program whose engine fails under it (run with TBRDMA_FAULTS=panic_after=N: the engine
 * panics on the N-th datagram a rail receives) and which then frees every object it holds, in
 * the order a careful program would and twice-NULL where the API allows it. Two devices on
 * loopback in one process, thread progress, WRITEs until something fails. Prints what failed
 * and "freed every object" at the end; any crash, abort or hang is the test's failure.
 *
 *   after_failure          exit 0: the engine failed, every call after it returned an error
 *                          and every free returned */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tbrdma.h"

#define REGION 65536
#define ALL_ACCESS                                                                           \
  (TBRDMA_ACCESS_LOCAL_WRITE | TBRDMA_ACCESS_REMOTE_WRITE | TBRDMA_ACCESS_REMOTE_READ |      \
   TBRDMA_ACCESS_REMOTE_ATOMIC)

struct side {
  tbrdma_device *dev;
  tbrdma_pd *pd;
  tbrdma_mr *mr;
  tbrdma_cq *cq;
  tbrdma_qp *qp;
};

static tbrdma_listener *listener;
static struct side server, client;
static int accept_rc;

static void *accept_thread(void *arg) {
  (void)arg;
  accept_rc = tbrdma_accept(listener, server.pd, server.cq, server.cq, NULL, 0, 10000, &server.qp);
  return NULL;
}

static int open_side(struct side *s) {
  int rc = tbrdma_device_open("127.0.0.1", TBRDMA_ENGINE_SOCKETS, TBRDMA_PROGRESS_THREAD, &s->dev);
  if (rc == TBRDMA_OK) rc = tbrdma_pd_alloc(s->dev, &s->pd);
  if (rc == TBRDMA_OK) rc = tbrdma_mr_alloc(s->pd, REGION, ALL_ACCESS, &s->mr);
  if (rc == TBRDMA_OK) rc = tbrdma_cq_create(s->dev, 256, &s->cq);
  return rc;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Frees in the order a program would: queue pairs, listener, CQs, regions, domains, devices.
 * NULL pointers are passed on purpose: every free ignores NULL. */
static void free_side(struct side *s) {
  tbrdma_qp_free(s->qp);
  tbrdma_cq_free(s->cq);
  tbrdma_mr_free(s->mr);
  tbrdma_pd_free(s->pd);
  tbrdma_device_close(s->dev);
  memset(s, 0, sizeof *s);
}

int main(void) {
  int failed = 0; /* some call reported the engine's failure */
  int rc = open_side(&server);
  if (rc == TBRDMA_OK) rc = open_side(&client);
  if (rc == TBRDMA_OK) rc = tbrdma_listen(server.dev, 0, &listener);
  if (rc != TBRDMA_OK) {
    fprintf(stderr, "setup failed before any traffic (%d): %s\n", rc, tbrdma_last_error());
    return 2;
  }
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", tbrdma_listener_port(listener));
  pthread_t t;
  pthread_create(&t, NULL, accept_thread, NULL);
  rc = tbrdma_connect(client.pd, addr, client.cq, client.cq, NULL, 0, 10000, &client.qp);
  pthread_join(t, NULL);
  if (rc != TBRDMA_OK || accept_rc != TBRDMA_OK) {
    /* The engine may fail during the handshake already: that is a failure too. */
    printf("connection setup failed: connect %d, accept %d: %s\n", rc, accept_rc, tbrdma_last_error());
    failed = 1;
  }

  /* WRITEs of the client's region into the server's until a post or a completion fails. */
  unsigned char *src = tbrdma_mr_addr(client.mr);
  memset(src, 0x5a, REGION);
  double deadline = now() + 20.0;
  uint64_t posted = 0, completed = 0;
  while (!failed && now() < deadline) {
    if (posted - completed < 8) {
      tbrdma_send_wr wr;
      memset(&wr, 0, sizeof wr);
      wr.wr_id = posted;
      wr.opcode = TBRDMA_WR_WRITE;
      wr.sge.addr = (uint64_t)(uintptr_t)src;
      wr.sge.length = 4096;
      wr.sge.lkey = tbrdma_mr_lkey(client.mr);
      wr.remote_addr = (uint64_t)(uintptr_t)tbrdma_mr_addr(server.mr);
      wr.rkey = tbrdma_mr_rkey(server.mr);
      rc = tbrdma_post_send(client.qp, &wr, 1);
      if (rc != TBRDMA_OK) {
        printf("post_send failed (%d): %s\n", rc, tbrdma_last_error());
        failed = 1;
        break;
      }
      posted++;
    }
    tbrdma_wc wc[8];
    int n = tbrdma_poll_cq(client.cq, wc, 8);
    if (n < 0) {
      printf("poll_cq failed (%d): %s\n", n, tbrdma_last_error());
      failed = 1;
      break;
    }
    for (int i = 0; i < n; i++) {
      if (wc[i].status != TBRDMA_WC_SUCCESS) {
        printf("a WRITE completed with status %u\n", wc[i].status);
        failed = 1;
      }
      completed++;
    }
  }
  if (!failed) {
    fprintf(stderr, "the engine never failed (%llu WRITEs completed): is TBRDMA_FAULTS set?\n",
            (unsigned long long)completed);
    return 3;
  }

  /* After the failure every call returns (an error or nothing to report), never crashes. */
  tbrdma_wc wc[8];
  printf("after the failure: poll_cq %d, progress %d\n", tbrdma_poll_cq(client.cq, wc, 8),
         tbrdma_device_progress(client.dev));
  if (client.qp) {
    tbrdma_recv_wr rwr;
    memset(&rwr, 0, sizeof rwr);
    printf("after the failure: post_recv %d\n", tbrdma_post_recv(client.qp, &rwr, 1));
  }
  tbrdma_pd *extra_pd = NULL;
  tbrdma_mr *extra_mr = NULL;
  rc = tbrdma_pd_alloc(client.dev, &extra_pd);
  if (rc == TBRDMA_OK) rc = tbrdma_mr_alloc(extra_pd, 4096, TBRDMA_ACCESS_LOCAL_WRITE, &extra_mr);
  printf("after the failure: a new region %d\n", rc);

  tbrdma_mr_free(extra_mr);
  tbrdma_pd_free(extra_pd);
  tbrdma_listener_free(listener);
  listener = NULL;
  free_side(&client);
  free_side(&server);
  /* NULL everywhere is ignored. */
  tbrdma_qp_free(NULL);
  tbrdma_listener_free(NULL);
  tbrdma_cq_free(NULL);
  tbrdma_mr_free(NULL);
  tbrdma_pd_free(NULL);
  tbrdma_device_close(NULL);
  printf("freed every object\n");
  return 0;
}

/* Writes and reads byte patterns between two processes through the real <infiniband/verbs.h>
 * API (ibv_post_send, ibv_post_recv and ibv_poll_cq are its inline functions, which call
 * through the context's operation table), and checks every byte on the other side: RDMA
 * WRITE, SEND_WITH_IMM, READ, FETCH_ADD, CMP_SWAP, unsignaled and inline sends, receives
 * posted before RTR, a protection error, and the refusals of what is not supported.
 *
 * usage: patterns server <device> <tcp-port>
 *        patterns client <device> <server-ip> <tcp-port>
 * With PATTERNS_RTR_DELAY_S=<seconds> in its environment, a side waits that long after the
 * address exchange before moving its queue pair to RTR (a peer that is late, as NCCL's
 * asynchronous connection setup can be: the other side must wait for it).
 * Prints "PASS" and exits 0 when every check held; "FAIL: ..." and exits 1 otherwise. */
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define LEN (1 << 20)
#define IMM 0x12345678u

#define CHECK(cond, ...)                                                                      \
	do {                                                                                  \
		if (!(cond)) {                                                                \
			printf("FAIL: " __VA_ARGS__);                                         \
			printf(" (%s:%d, errno %d)\n", __FILE__, __LINE__, errno);            \
			exit(1);                                                              \
		}                                                                             \
	} while (0)

struct announce {
	uint32_t qpn;
	uint8_t gid[16];
	uint64_t rw_addr, ro_addr, at_addr;
	uint32_t rw_rkey, ro_rkey, at_rkey;
};

static uint8_t pattern_w(size_t i) { return (uint8_t)(i * 7 + 13) ^ (uint8_t)(i >> 8); }
static uint8_t pattern_r(size_t i) { return (uint8_t)(i * 31 + 5) ^ (uint8_t)(i >> 11); }

static void xfer(int fd, void *buf, size_t len, int out)
{
	size_t done = 0;
	while (done < len) {
		ssize_t n = out ? write(fd, (char *)buf + done, len - done)
				: read(fd, (char *)buf + done, len - done);
		CHECK(n > 0, "side channel %s", out ? "write" : "read");
		done += n;
	}
}

static struct ibv_context *open_named(const char *name)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list, "ibv_get_device_list");
	for (int i = 0; i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), name)) {
			struct ibv_context *ctx = ibv_open_device(list[i]);
			ibv_free_device_list(list);
			return ctx;
		}
	CHECK(0, "no device %s", name);
	return NULL;
}

static struct ibv_wc wait_one(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	CHECK(n == 1, "ibv_poll_cq returned %d", n);
	return wc;
}

static void to_rtr_rts(struct ibv_qp *qp, const struct announce *peer, int rts)
{
	struct ibv_qp_attr a = {0};
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = peer->qpn;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
					     IBV_QP_MIN_RNR_TIMER),
	      "modify to RTR");
	if (!rts)
		return;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
	      "modify to RTS");
}

/* What must be refused, and how. */
static void unsupported(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD};
	ia.cap.max_send_wr = ia.cap.max_recv_wr = 1;
	ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
	errno = 0;
	CHECK(!ibv_create_qp(pd, &ia) && errno == EOPNOTSUPP, "a UD QP must fail with EOPNOTSUPP");
	ia.qp_type = IBV_QPT_UC;
	errno = 0;
	CHECK(!ibv_create_qp(pd, &ia) && errno == EOPNOTSUPP, "a UC QP must fail with EOPNOTSUPP");
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_sge = 2;
	errno = 0;
	CHECK(!ibv_create_qp(pd, &ia) && errno == EINVAL, "2 SGEs must fail with EINVAL");
	struct ibv_srq_init_attr sa = {.attr = {.max_wr = 4, .max_sge = 1}};
	errno = 0;
	CHECK(!ibv_create_srq(pd, &sa) && errno == EOPNOTSUPP, "an SRQ must fail with EOPNOTSUPP");
	errno = 0;
	CHECK(!ibv_create_comp_channel(ctx) && errno == EOPNOTSUPP,
	      "a completion channel must fail with EOPNOTSUPP");
	CHECK(ibv_req_notify_cq(cq, 0) == EOPNOTSUPP, "req_notify_cq must answer EOPNOTSUPP");
}

int main(int argc, char **argv)
{
	int server = argc == 4 && !strcmp(argv[1], "server");
	CHECK(server || (argc == 5 && !strcmp(argv[1], "client")), "usage");
	struct ibv_context *ctx = open_named(argv[2]);
	CHECK(ctx, "ibv_open_device");
	struct ibv_port_attr port;
	CHECK(!ibv_query_port(ctx, 1, &port), "ibv_query_port");
	CHECK(port.state == IBV_PORT_ACTIVE && port.link_layer == IBV_LINK_LAYER_ETHERNET,
	      "port state %d link layer %d", port.state, port.link_layer);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	CHECK(pd && cq, "pd/cq");
	unsupported(ctx, pd, cq);

	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
		     IBV_ACCESS_REMOTE_ATOMIC;
	uint8_t *rw = calloc(1, LEN), *ro = calloc(1, LEN);
	uint64_t *at = aligned_alloc(64, 64);
	CHECK(rw && ro && at, "memory");
	*at = 100;
	for (size_t i = 0; i < LEN; i++)
		ro[i] = server ? pattern_r(i) : 0;
	struct ibv_mr *rw_mr = ibv_reg_mr(pd, rw, LEN, access);
	/* Remote read only: a WRITE into it must fail at the responder. */
	struct ibv_mr *ro_mr = ibv_reg_mr(pd, ro, LEN, server ? IBV_ACCESS_REMOTE_READ : access);
	struct ibv_mr *at_mr = ibv_reg_mr(pd, at, 64, access);
	CHECK(rw_mr && ro_mr && at_mr, "ibv_reg_mr");
	errno = 0;
	CHECK(!ibv_reg_mr(pd, rw, LEN, IBV_ACCESS_REMOTE_WRITE) && errno == EINVAL,
	      "remote write without local write must fail with EINVAL");

	struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC};
	ia.cap.max_send_wr = 32;
	ia.cap.max_recv_wr = 8;
	ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
	ia.cap.max_inline_data = 64;
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	CHECK(qp, "ibv_create_qp");
	CHECK(ia.cap.max_inline_data >= 64, "inline %u", ia.cap.max_inline_data);
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1};
	a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
	      "modify to INIT");
	struct ibv_send_wr *bad;
	struct ibv_sge sge;
	struct ibv_send_wr wr;
	errno = 0;
	memset(&wr, 0, sizeof(wr));
	wr.opcode = IBV_WR_SEND;
	CHECK(ibv_post_send(qp, &wr, &bad) == EINVAL && bad == &wr, "a send in INIT must fail");

	/* Receives posted in INIT, before the peer is known. */
	for (int i = 0; i < 4; i++) {
		struct ibv_sge rs = {.addr = (uintptr_t)(rw + LEN - 4096 + i * 64), .length = 64, .lkey = rw_mr->lkey};
		struct ibv_recv_wr rwr = {.wr_id = 1000 + i, .sg_list = &rs, .num_sge = 1}, *rbad;
		CHECK(!ibv_post_recv(qp, &rwr, &rbad), "post_recv in INIT");
	}

	union ibv_gid gid;
	CHECK(!ibv_query_gid(ctx, 1, 0, &gid), "ibv_query_gid");
	struct announce me = {.qpn = qp->qp_num, .rw_addr = (uintptr_t)rw, .rw_rkey = rw_mr->rkey,
			      .ro_addr = (uintptr_t)ro, .ro_rkey = ro_mr->rkey,
			      .at_addr = (uintptr_t)at, .at_rkey = at_mr->rkey};
	memcpy(me.gid, gid.raw, 16);
	struct announce peer;
	int fd;
	if (server) {
		int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
		setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
		CHECK(!bind(l, (struct sockaddr *)&sa, sizeof(sa)) && !listen(l, 1), "listen");
		printf("listening\n");
		fflush(stdout);
		fd = accept(l, NULL, NULL);
		CHECK(fd >= 0, "accept");
	} else {
		fd = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[4]))};
		inet_pton(AF_INET, argv[3], &sa.sin_addr);
		CHECK(!connect(fd, (struct sockaddr *)&sa, sizeof(sa)), "connect");
	}
	xfer(fd, &me, sizeof(me), 1);
	xfer(fd, &peer, sizeof(peer), 0);
	if (getenv("PATTERNS_RTR_DELAY_S"))
		sleep(atoi(getenv("PATTERNS_RTR_DELAY_S")));
	to_rtr_rts(qp, &peer, 1);

	if (server) {
		/* 1: the client WRITEs a pattern, then a zero-byte SEND_WITH_IMM says it is there. */
		struct ibv_wc wc = wait_one(cq);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.wr_id == 1000,
		      "first receive: status %d opcode %d wr_id %lu", wc.status, wc.opcode, wc.wr_id);
		CHECK(wc.wc_flags & IBV_WC_WITH_IMM && ntohl(wc.imm_data) == IMM && wc.byte_len == 0,
		      "immediate %x flags %x len %u", ntohl(wc.imm_data), wc.wc_flags, wc.byte_len);
		CHECK(wc.qp_num == qp->qp_num && wc.src_qp == peer.qpn, "qp numbers in the completion");
		for (size_t i = 0; i < LEN - 4096; i++)
			CHECK(rw[i] == pattern_w(i), "written byte %zu is %u, not %u", i, rw[i], pattern_w(i));
		/* 2: an inline SEND of 48 bytes. */
		wc = wait_one(cq);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1001 && wc.byte_len == 48,
		      "inline receive: status %d wr_id %lu len %u", wc.status, wc.wr_id, wc.byte_len);
		for (int i = 0; i < 48; i++)
			CHECK(rw[LEN - 4096 + 64 + i] == (uint8_t)(0xa0 + i), "inline byte %d", i);
		char ok = 'W';
		xfer(fd, &ok, 1, 1);
		/* The client READs ro, runs atomics on at, then fails a WRITE into ro. */
		xfer(fd, &ok, 1, 0);
		CHECK(ok == 'D', "client said %c", ok);
		CHECK(*at == 7, "atomic word %lu, not 7", (unsigned long)*at);
		for (size_t i = 0; i < LEN; i++)
			CHECK(ro[i] == pattern_r(i), "the refused WRITE changed byte %zu", i);
		printf("PASS\n");
		return 0;
	}

	/* Client. 1: WRITE the pattern (signaled), then SEND_WITH_IMM with no data. */
	for (size_t i = 0; i < LEN; i++)
		ro[i] = pattern_w(i);
	sge = (struct ibv_sge){.addr = (uintptr_t)ro, .length = LEN - 4096, .lkey = ro_mr->lkey};
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = 1;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = peer.rw_addr;
	wr.wr.rdma.rkey = peer.rw_rkey;
	struct ibv_send_wr imm = {.wr_id = 2, .opcode = IBV_WR_SEND_WITH_IMM,
				  .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(IMM)};
	wr.next = &imm;
	CHECK(!ibv_post_send(qp, &wr, &bad), "post WRITE + SEND_WITH_IMM");
	struct ibv_wc wc = wait_one(cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1 && wc.opcode == IBV_WC_RDMA_WRITE,
	      "WRITE completion: status %d wr_id %lu opcode %d", wc.status, wc.wr_id, wc.opcode);
	wc = wait_one(cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 2 && wc.opcode == IBV_WC_SEND, "SEND completion");
	/* 2: inline SEND from a stack buffer that is overwritten right after posting. */
	uint8_t stack[48];
	for (int i = 0; i < 48; i++)
		stack[i] = 0xa0 + i;
	sge = (struct ibv_sge){.addr = (uintptr_t)stack, .length = 48, .lkey = 0};
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = 3;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	CHECK(!ibv_post_send(qp, &wr, &bad), "post inline SEND");
	memset(stack, 0, sizeof(stack));
	wc = wait_one(cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 3, "inline SEND completion");
	char ok;
	xfer(fd, &ok, 1, 0);
	CHECK(ok == 'W', "server said %c", ok);

	/* 3: READ the server's pattern, in four requests, and check every byte. */
	memset(rw, 0, LEN);
	for (int k = 0; k < 4; k++) {
		sge = (struct ibv_sge){.addr = (uintptr_t)rw + k * (LEN / 4), .length = LEN / 4, .lkey = rw_mr->lkey};
		memset(&wr, 0, sizeof(wr));
		wr.wr_id = 10 + k;
		wr.sg_list = &sge;
		wr.num_sge = 1;
		wr.opcode = IBV_WR_RDMA_READ;
		wr.send_flags = IBV_SEND_SIGNALED;
		wr.wr.rdma.remote_addr = peer.ro_addr + k * (LEN / 4);
		wr.wr.rdma.rkey = peer.ro_rkey;
		CHECK(!ibv_post_send(qp, &wr, &bad), "post READ");
	}
	for (int k = 0; k < 4; k++) {
		wc = wait_one(cq);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_READ && wc.byte_len == LEN / 4,
		      "READ completion: status %d len %u", wc.status, wc.byte_len);
	}
	for (size_t i = 0; i < LEN; i++)
		CHECK(rw[i] == pattern_r(i), "read byte %zu is %u, not %u", i, rw[i], pattern_r(i));

	/* 4: FETCH_ADD 5 on 100, then CMP_SWAP 105 -> 7. */
	uint64_t *res = (uint64_t *)rw;
	sge = (struct ibv_sge){.addr = (uintptr_t)res, .length = 8, .lkey = rw_mr->lkey};
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = 20;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.atomic.remote_addr = peer.at_addr;
	wr.wr.atomic.rkey = peer.at_rkey;
	wr.wr.atomic.compare_add = 5;
	CHECK(!ibv_post_send(qp, &wr, &bad), "post FETCH_ADD");
	wc = wait_one(cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_FETCH_ADD && *res == 100,
	      "FETCH_ADD: status %d old %lu", wc.status, (unsigned long)*res);
	wr.wr_id = 21;
	wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
	wr.wr.atomic.compare_add = 105;
	wr.wr.atomic.swap = 7;
	CHECK(!ibv_post_send(qp, &wr, &bad), "post CMP_SWAP");
	wc = wait_one(cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_COMP_SWAP && *res == 105,
	      "CMP_SWAP: status %d old %lu", wc.status, (unsigned long)*res);

	/* 5: ten unsignaled WRITEs and one signaled: exactly one completion, the signaled one. */
	for (int k = 0; k < 11; k++) {
		sge = (struct ibv_sge){.addr = (uintptr_t)ro, .length = 4096, .lkey = ro_mr->lkey};
		memset(&wr, 0, sizeof(wr));
		wr.wr_id = 100 + k;
		wr.sg_list = &sge;
		wr.num_sge = 1;
		wr.opcode = IBV_WR_RDMA_WRITE;
		wr.send_flags = k == 10 ? IBV_SEND_SIGNALED : 0;
		wr.wr.rdma.remote_addr = peer.rw_addr + k * 4096;
		wr.wr.rdma.rkey = peer.rw_rkey;
		CHECK(!ibv_post_send(qp, &wr, &bad), "post unsignaled WRITE %d", k);
	}
	wc = wait_one(cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 110, "the signaled WRITE: wr_id %lu", wc.wr_id);
	/* Its completion means the ten before it completed too; none of them may show up. */
	struct ibv_wc extra;
	for (int i = 0; i < 10000; i++)
		CHECK(ibv_poll_cq(cq, 1, &extra) == 0, "an unsignaled WRITE completed: wr_id %lu", extra.wr_id);

	/* 6: a WRITE into a region registered for remote READ only fails at the responder. */
	sge = (struct ibv_sge){.addr = (uintptr_t)ro, .length = 64, .lkey = ro_mr->lkey};
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = 200;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = peer.ro_addr;
	wr.wr.rdma.rkey = peer.ro_rkey;
	CHECK(!ibv_post_send(qp, &wr, &bad), "post the forbidden WRITE");
	wc = wait_one(cq);
	CHECK(wc.wr_id == 200 && wc.status == IBV_WC_REM_ACCESS_ERR,
	      "forbidden WRITE: status %d (%s), not REM_ACCESS_ERR", wc.status, ibv_wc_status_str(wc.status));
	struct ibv_qp_init_attr qia;
	CHECK(!ibv_query_qp(qp, &a, IBV_QP_STATE, &qia) && a.qp_state == IBV_QPS_ERR,
	      "after the error the QP is in state %d, not ERR", a.qp_state);
	ok = 'D';
	xfer(fd, &ok, 1, 1);
	CHECK(!ibv_destroy_qp(qp) && !ibv_dereg_mr(rw_mr) && !ibv_dereg_mr(ro_mr) && !ibv_dereg_mr(at_mr),
	      "teardown");
	CHECK(!ibv_destroy_cq(cq) && !ibv_dealloc_pd(pd) && !ibv_close_device(ctx), "teardown");
	printf("PASS\n");
	return 0;
}

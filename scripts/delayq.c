/*
 * delayq: hold every packet of an NFQUEUE queue for a fixed delay, then accept it.
 *
 * The kernels we run on have no `netem` qdisc, so scripts/netem.py adds one-way delay with an
 * iptables rule `-t mangle -A PREROUTING -i eth0 -j NFQUEUE --queue-num 0` in the *receiving*
 * peer's namespace and one delayq process per namespace. Delay is constant, so packets leave in
 * arrival order: a FIFO of (packet id, due time) is enough, and one batch verdict accepts every
 * packet up to the newest due id (this also releases packets whose queue messages were lost to a
 * netlink buffer overrun, so nothing stays stuck in the kernel).
 *
 * Usage: delayq QUEUE_NUM DELAY_US
 * Prints "ready" on stdout once the queue is bound; exits cleanly on SIGTERM/SIGINT, printing
 * counters on stderr. Build: gcc -O2 -o delayq delayq.c -lnetfilter_queue -lnfnetlink
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define RING_SIZE (1u << 18) /* > queue max length below */
#define QUEUE_MAXLEN 200000u

static uint32_t ring_id[RING_SIZE];
static int64_t ring_due[RING_SIZE];
static uint32_t ring_head, ring_tail; /* head: oldest; tail: next free */
static int64_t delay_ns;
static volatile sig_atomic_t stop;
static unsigned long long n_queued, n_overflow, n_missed; /* missed: ids whose queue message never came */
static uint32_t last_seen_id;
static int seen_any;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)msg;
    (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph) return 0;
    uint32_t id = ntohl(ph->packet_id);
    if (seen_any && id - last_seen_id > 1) n_missed += id - last_seen_id - 1;
    last_seen_id = id;
    seen_any = 1;
    if (ring_tail - ring_head >= RING_SIZE) { /* cannot happen with QUEUE_MAXLEN < RING_SIZE */
        n_overflow++;
        return nfq_set_verdict(qh, id, NF_DROP, 0, NULL);
    }
    ring_id[ring_tail % RING_SIZE] = id;
    ring_due[ring_tail % RING_SIZE] = now_ns() + delay_ns;
    ring_tail++;
    n_queued++;
    return 0;
}

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE_NUM DELAY_US\n", argv[0]);
        return 2;
    }
    uint16_t queue_num = (uint16_t)atoi(argv[1]);
    delay_ns = atoll(argv[2]) * 1000LL;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct nfq_handle *h = nfq_open();
    if (!h) { perror("nfq_open"); return 1; }
    struct nfq_q_handle *qh = nfq_create_queue(h, queue_num, &on_packet, NULL);
    if (!qh) { perror("nfq_create_queue"); return 1; }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) { perror("nfq_set_mode"); return 1; }
    if (nfq_set_queue_maxlen(qh, QUEUE_MAXLEN) < 0) perror("nfq_set_queue_maxlen (ignored)");
    /* Accept GSO super-packets whole when offloads are on (fewer messages); harmless otherwise. */
    nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
    int fd = nfq_fd(h);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 16u << 20);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);

    /* Sleep to the due time with a 1 us timer slack instead of spinning: on a 2-core host a spinning
     * delayq per namespace starves the very peers whose traffic it delays. */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);

    printf("ready\n");
    fflush(stdout);

    static char buf[1 << 16];
    while (!stop) {
        struct timespec ts, *timeout = NULL; /* NULL: nothing held, wait for a packet */
        if (ring_head != ring_tail) {
            int64_t wait = ring_due[ring_head % RING_SIZE] - now_ns();
            if (wait < 0) wait = 0;
            ts.tv_sec = (time_t)(wait / 1000000000LL);
            ts.tv_nsec = (long)(wait % 1000000000LL);
            timeout = &ts;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int rc = ppoll(&pfd, 1, timeout, NULL);
        if (rc < 0 && errno != EINTR) { perror("poll"); break; }
        if (rc > 0 && (pfd.revents & POLLIN)) {
            for (int i = 0; i < 256; i++) { /* drain what is there, bounded */
                ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
                if (n < 0) break;
                nfq_handle_packet(h, buf, (int)n);
            }
        }
        int64_t t = now_ns();
        uint32_t last = 0;
        int have = 0;
        while (ring_head != ring_tail && ring_due[ring_head % RING_SIZE] <= t) {
            last = ring_id[ring_head % RING_SIZE];
            ring_head++;
            have = 1;
        }
        if (have) nfq_set_verdict_batch(qh, last, NF_ACCEPT);
    }
    fprintf(stderr, "delayq: queued=%llu overflow=%llu missed=%llu pending=%u\n", n_queued, n_overflow, n_missed,
            ring_tail - ring_head);
    if (ring_head != ring_tail) nfq_set_verdict_batch(qh, ring_id[(ring_tail - 1) % RING_SIZE], NF_ACCEPT);
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}

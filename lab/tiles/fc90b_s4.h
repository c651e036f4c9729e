/* lab: the Hopper backward at d 64 with 64-row steps and 4 stages of the (Q, dO) ring, the default of the twenty-first
 * session's first commit (48b6694), before 128-row steps (7-19% less main-kernel time on the H200, lab/LOG.md) */
#define FC90_BTILE_64 fc90_btile{64, 128, 64, 4}

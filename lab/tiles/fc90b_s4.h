/* lab: the Hopper backward with 4 stages of the (Q, dO) ring at d 64 (2 shipped): 1.4-3.3% less main-kernel time
 * on the H200 (lab/LOG.md, twentieth session); not yet run through gpu_bwd and the sanitizers on the GPU */
#define FC90_BTILE_64 fc90_btile{64, 128, 64, 4}

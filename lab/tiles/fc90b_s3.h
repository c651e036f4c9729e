/* lab: the Hopper backward with 3 stages of the (Q, dO) ring at d 64 (2 shipped; at d 128 a third stage does not
 * fit): a step's loads one step further ahead, for the long-scoreboard waits on the full barriers */
#define FC90_BTILE_64 fc90_btile{64, 128, 64, 3}

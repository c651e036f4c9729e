/* lab: backward tiles for two blocks per SM: d64 dK/dV with 32-query steps, the dQ kernel with 64 (d64) and
 * 32 (d128) key steps under a 128-register cap */
#define FC_BTILE_64 fc_btile{64, 128, 32, 8, 1, 2, 64, 64, 4, 2}
#define FC_BTILE_128 fc_btile{128, 128, 64, 8, 1, 1, 64, 32, 4, 2}

/* lab: backward d128 dK/dV with 32-query steps (half the S / dP registers) */
#define FC_BTILE_128 fc_btile{128, 128, 32, 8, 1, 1, 64, 64, 4, 1}

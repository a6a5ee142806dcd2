/* Shared by the C GEMMs (qgemm.c, qdot.c): a switch body that calls CALL with the row count N as a
 * compile-time constant from 1 to RMAX (defined by the includer, per instruction set: 4 or 8), so that the
 * per-row accumulators of the inlined kernel live in registers. */
#if RMAX == 8
#define ROWS(CALL)                                                                              \
    case 1: { const long N = 1; CALL; break; } case 2: { const long N = 2; CALL; break; }        \
    case 3: { const long N = 3; CALL; break; } case 4: { const long N = 4; CALL; break; }        \
    case 5: { const long N = 5; CALL; break; } case 6: { const long N = 6; CALL; break; }        \
    case 7: { const long N = 7; CALL; break; } default: { const long N = 8; CALL; break; }
#elif RMAX == 4
#define ROWS(CALL)                                                                              \
    case 1: { const long N = 1; CALL; break; } case 2: { const long N = 2; CALL; break; }        \
    case 3: { const long N = 3; CALL; break; } default: { const long N = 4; CALL; break; }
#else
#error "RMAX must be 4 or 8"
#endif

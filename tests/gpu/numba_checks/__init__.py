"""Scripts that test_numba_pack.py runs in subprocesses, one check each, as
`python -m tests.gpu.numba_checks.<name>`.

They run in a process of their own because Numba reads NUMBA_ENABLE_CUDASIM once, when it is
first imported: the simulator checks need it on, the lowering check needs it off, and another
test in the pytest process may have imported numba already. The lowering check also patches
Numba's idea of the current device, which must not leak into other tests.
"""

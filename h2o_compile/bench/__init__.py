"""Decode benchmarks: transformers' caches vs H2O, on CPU (decode.py) and CUDA (cuda.py).

machine.py reads the machine (bandwidth, RSS, CPU load), contenders.py wraps each cache behind one decode
interface, report.py writes the JSON, markdown and plot.
"""

"""kvferry-proxy: an OpenAI-compatible proxy in front of prefill and decode vLLM instances.

Run it as ``kvferry-proxy`` (the wheel's console command) or ``python3 -m kvferry.proxy``;
``--help`` lists the flags, config.py the file format, forward.py what happens to a request,
metrics.py what /metrics reports. Needs aiohttp and prometheus_client (Debian: python3-aiohttp,
python3-prometheus-client; pip: kvferry[proxy]).
"""

"""python3 -m kvferry.proxy: the same as the kvferry-proxy command."""

from .cli import main

if __name__ == "__main__":
    main()

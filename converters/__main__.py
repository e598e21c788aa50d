from converters.cli import main

# the guard matters: megatron's checkpoint code may start worker processes
if __name__ == "__main__":
    raise SystemExit(main())

from trainprof.cli import main

main(prog_name="trainprof")

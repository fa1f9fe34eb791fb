from batchrun.cli.main import main

main()

from ppsplit.cli import main

main()

from ppsplit.app.cli import main

main()

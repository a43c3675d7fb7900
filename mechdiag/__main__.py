from mechdiag.cli import main

main()
